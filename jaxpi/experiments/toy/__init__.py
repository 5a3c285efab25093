"""The toy lookup study: the seed report's result (SFT that breaks cost ordering, then
effort-ordered GRPO against the binary baseline) at the scale of a tiny model on the CPU.

    sessions.py   scripted LookupEnv sessions for SFT; the "toy_lookup" data source
    bases.py      the "toy-random" and "toy-copy" bases (a scaled LM head; copy pre-training)
    evaluate.py   pass rate and reasoning tokens per level of a trained run
    result.py     the comparison `jaxpi demo` runs: toy SFT, then effort-ordered and binary GRPO
    study*.py     `jaxpi study`: that comparison over K seeds, resumable, with intervals across
                  seeds: settings (study_config), runs (study_run), numbers (study_stats),
                  tables and picture (study_tables), one evaluation's noise (study_noise)

`python -m jaxpi.experiments.toy base OUT_DIR` writes the toy base; `... eval RUN_DIR` samples an
SFT run's latest checkpoint (`__main__.py`).
"""
