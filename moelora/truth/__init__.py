"""The outside truths moelora's served rows are checked against: `hf_peft.py` (HF + PEFT
generating each row alone, and HF's own noise between two of its experts implementations)
and `w8a8.py` (rows on FP8 experts: transformers' eager experts loop with W8A8 base GEMMs
plus PEFT's own delta weights). Nothing here calls moelora's kernels, backends or reference:
a truth shares no code path with what it checks. `moelora generate` and benchmarks/ import
them (benchmarks/ never imports the commands, and the installed transformers integration,
hf/, holds nothing that only checks it)."""
