"""`qtool calibrate`: importance matrices from a float model run block by block (blocks.py) over
calibration text (data.py), written as llama.cpp's GGUF imatrix (run.py)."""
