"""`jaxpi bench`'s human table: every timed figure as median (min–max)."""

from __future__ import annotations

from typing import Any


def _f(fig: dict[str, Any], scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    med, lo, hi = (fmt.format(fig[k] * scale) for k in ("median", "min", "max"))
    return f"{med} ({lo}–{hi})"


def format_table(report: dict[str, Any]) -> str:
    env, cfg, res = report["env"], report["config"], report["results"]
    m = cfg["model"]
    lines = [
        f"jaxpi bench {report['command']}   {env['date']}   {env['device_kind']} ({env['platform']}), "
        f"{env['threads']} threads   jax {env['jax']}"
        + (f", torch {env['torch']}, transformers {env['transformers']}" if "torch" in env else ""),
        f"  model: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers {m['layer_types']}, "
        f"vocab {m['vocab_size']}   seq {cfg['seq']} × batch {cfg['batch']}, {cfg['dtype']}, "
        f"LoRA rank {cfg['lora_rank']}   median (min–max) of {cfg['repeats']} after {cfg['warmup']} warm-up"
        + (
            f"   kernels: gdn {m['gdn_impl']}, norms {m['norm_impl']}, attention {m.get('attn_impl', 'jax')}"
            if "pallas" in (m.get("gdn_impl"), m.get("norm_impl"), m.get("attn_impl"))
            else ""
        ),
    ]
    if "train_step" in res:
        r = res["train_step"]
        j, pk = r["jaxpi"], r["peak"]
        lines += [
            "",
            "train-step (LoRA fwd + bwd + AdamW)",
            f"  model FLOPs/step {r['flops']['total'] / 1e9:.4g} G   matmul peak "
            f"({pk['dtype']} {pk['n']}²) {_f(pk['flop_per_s'], 1e-9)} GFLOP/s"
            + (
                f", by kernel time {pk['kernel_timed']['median_tflops'] * 1e3:.4g} GFLOP/s"
                f" (MFU against the {pk.get('mfu_peak_source')} figure)"
                if "median_tflops" in pk.get("kernel_timed", {})
                else ""
            ),
            f"  jaxpi    step {_f(j['step_s'])} s   {_f(j['tokens_per_s'])} tokens/s   "
            f"{_f(j['flop_per_s'], 1e-9)} GFLOP/s   MFU {_f(j['mfu'], 100, '{:.1f}')} %   "
            f"compile {j['compile_s']:.1f} s",
        ]
        if "torch" in r:
            t = r["torch"]
            lines += [
                f"  torch    step {_f(t['step_s'])} s   {_f(t['tokens_per_s'])} tokens/s   "
                f"{t['flop_per_s']['median'] / 1e9:.3g} GFLOP/s   MFU {100 * t['mfu']:.1f} %",
                f"  jaxpi / torch tokens/s: {r['speedup_tokens_per_s']:.2f}× (ratio of medians)   first-step loss "
                f"jaxpi {j['loss_first']:.5f}  torch {t['loss_first']:.5f}",
            ]
            if "speedup_pairs" in r:
                lines.append(
                    f"  jaxpi / torch per back-to-back pair: {_f(r['speedup_pairs'], 1, '{:.2f}')}×   "
                    f"jaxpi MFU vs each repeat's adjacent peak {_f(j['mfu_adjacent'], 100, '{:.1f}')} % "
                    f"(peak {_f(j['peak_adjacent'], 1e-9)} GFLOP/s, wall clock)"
                )
    if "gdn" in res:
        g = res["gdn"]
        s = g["shape"]
        lines += [
            "",
            f"gdn (chunked gated delta rule, B {s['batch']} T {s['seq']} H {s['heads']} "
            f"Dk {s['dk']} Dv {s['dv']} chunk {s['chunk']})",
            f"  jaxpi    fwd {_f(g['jaxpi']['fwd_s'], 1e3)} ms   fwd+bwd {_f(g['jaxpi']['fwd_bwd_s'], 1e3)} ms"
            f"   ({g.get('impl', 'jax')}{', interpreted' if g.get('interpreted') else ''})",
        ]
        if "plain_jax" in g:
            impl = g["impl"]
            fwd, fwd_bwd = g[f"speedup_{impl}_fwd"], g[f"speedup_{impl}_fwd_bwd"]
            lines += [
                f"  plain JAX fwd {_f(g['plain_jax']['fwd_s'], 1e3)} ms   fwd+bwd {_f(g['plain_jax']['fwd_bwd_s'], 1e3)} ms",
                f"  plain JAX / {impl} time: fwd {fwd:.2f}×   fwd+bwd {fwd_bwd:.2f}×   "
                f"max |Δ out| {g[f'max_abs_diff_{impl}_vs_plain']:.2e}",
            ]
        if "torch" in g:
            lines += [
                f"  torch    fwd {_f(g['torch']['fwd_s'], 1e3)} ms   fwd+bwd {_f(g['torch']['fwd_bwd_s'], 1e3)} ms",
                f"  torch / jaxpi time: fwd {g['speedup_fwd']:.2f}×   fwd+bwd {g['speedup_fwd_bwd']:.2f}×"
                f"   max |Δ out| {g['max_abs_diff']:.2e}",
            ]
    if "decode" in res:
        d = res["decode"]
        bw = d["bandwidth"]["bytes_per_s"]
        lines += [
            "",
            f"decode (greedy, {d['prompt_len']}-token prompts, {d['new_tokens']} new tokens, {d['model']['dtype']}"
            + (f", checkpoint {d['checkpoint']}" if d.get("checkpoint") else "")
            + f")   copy bandwidth {_f(bw, 1e-9)} GB/s",
        ]
        for b, v in d["batches"].items():
            for name in ("jaxpi", "vllm"):
                if name in v:
                    e = v[name]
                    lines.append(
                        f"  batch {b:>3}  {name:<5}  {_f(e['tokens_per_s'])} tokens/s   call {_f(e['call_s'])} s   "
                        f"{_f(e['bandwidth_fraction'], 100, '{:.1f}')} % of the bandwidth limit"
                    )
                    if "decode_step_s" in e:
                        lines.append(
                            f"                    decode step {_f(e['decode_step_s'], 1e3, '{:.2f}')} ms   "
                            f"{_f(e['bandwidth_fraction_per_step'], 100, '{:.1f}')} % of the limit per step"
                        )
            lines.append(
                f"             {v['bytes_per_step']['total'] / 1e6:.1f} MB per step, bandwidth around each "
                f"repeat {_f(v['bandwidth_adjacent'], 1e-9)} GB/s"
            )
            if "speedup_tokens_per_s" in v:
                g = v["greedy_agreement"]
                lines.append(
                    f"             jaxpi / vLLM tokens/s {v['speedup_tokens_per_s']:.2f}× (medians), per pair "
                    f"{_f(v['speedup_pairs'], 1, '{:.2f}')}×   greedy rows identical {g['rows_identical']}/{g['rows']}, "
                    f"mean common prefix {g['mean_common_prefix']:.1f}"
                )
    if "compile" in res:
        c = res["compile"]
        lines += ["", "compile (LoRA train step, trace + lower + compile)"]
        for n, v in c["layers"].items():
            lines.append(
                f"  {n:>3} layers   {_f(v['total_s'])} s   (lower {v['lower_s']['median']:.2f}, "
                f"compile {v['compile_s']['median']:.2f})"
                + (f"   CPU {_f(v['cpu_s'])} s" if "cpu_s" in v else "")
            )
        lines.append(
            f"  {c['deepest']} / {c['shallowest']} layers: {c['ratio_deepest_over_shallowest']:.2f}×"
            + (
                f" wall, {c['ratio_cpu_deepest_over_shallowest']:.2f}× CPU"
                if "ratio_cpu_deepest_over_shallowest" in c
                else ""
            )
        )
    if "profile" in res:
        pr = res["profile"]
        what = (
            f"decode loop at batch {pr['batch']}, per iteration"
            if pr.get("mode") == "decode"
            else "jaxpi train step"
        )
        lines += ["", f"profile ({what}: op time {pr['op_seconds_per_step']:.3g} s; trace {pr['trace_dir']})"]
        if pr.get("mode") == "decode":
            lines.append(
                f"  wall {pr['wall_seconds_per_step'] * 1e3:.2f} ms per token (the whole generate), ops busy "
                f"{pr['busy_seconds_per_step'] * 1e3:.2f} ms, {pr['bytes_per_step']['total'] / 1e6:.1f} MB to move"
            )
        # a decode iteration takes milliseconds, a train step seconds
        scale, unit = (1e3, "ms") if pr.get("mode") == "decode" else (1.0, "s")
        for part, v in pr["parts"].items():
            lines.append(f"  {100 * v['share']:5.1f} %  {v['s'] * scale:8.4f} {unit:<2}  {part}")
        lines.append("  top ops:")
        for op in pr["top_ops"][:12]:
            lines.append(f"    {op['s'] * scale:8.4f} {unit:<2}  {op['op']:<28} {op['op_name'][-90:]}")
    return "\n".join(lines)
