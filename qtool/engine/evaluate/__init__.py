"""`qtool eval FLOAT QUANT`: both models on the same tokens, compared window by window
(definitions in docs/eval.md). quant: QUANT into FLOAT's architecture; passes: the loops;
layers: per-Linear output error; run: the whole; many: several QUANTs against one float pass.
FLOAT, the text, the tokens and the hooks are engine/model/'s, shared with calibration."""
