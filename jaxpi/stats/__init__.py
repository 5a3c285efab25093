"""The statistics of GRPO reports, the toy study and the agent evaluation: intervals, per-level
numbers with ordering ratios, paired differences, the Markdown table and the frontier picture."""
