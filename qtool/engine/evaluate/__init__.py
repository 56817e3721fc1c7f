"""`qtool eval FLOAT QUANT`: both models on the same tokens, compared window by window
(definitions in docs/eval.md). text: the text and its cuts; models: FLOAT; quant and readers:
QUANT into FLOAT's architecture; tokens: the ids; passes: the loops; layers: per-Linear
output error; run: the whole. transformers (the interop extra) is imported by hf.py only."""
