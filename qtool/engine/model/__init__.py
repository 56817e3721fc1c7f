"""What eval and calibration share to run a float model: config (the model directory as
`detect` finds it, its kind and window), models (the model built empty or loaded, FLOAT),
readers (tensors through qtool's readers), checked and hf (the one door to transformers, given
private copies of the tokenizer's files), text and tokens (what the model runs on), hooks
(forward hooks held and removed as one). transformers is imported by hf.py only."""
