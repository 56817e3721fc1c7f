"""Files: the safetensors header, checkpoint readers, streaming writers, atomic outputs."""
