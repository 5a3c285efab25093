"""`jaxpi bench`: measured speed of the LoRA train step, the DeltaNet kernel, decoding and compiling.

Every figure is a median over timed repeats after warm-up, reported with its min and max; MFU is
model FLOPs (`jaxpi.bench.flops`) over the matmul peak measured in the same run
(`jaxpi.bench.peak`). `--vs torch` runs the same step in `transformers` + `peft` on the same
weights and tokens. `jaxpi bench gpu` (`gpu.py`) is the 27B-shaped run on one accelerator.
"""
