"""The work: planning, the quantize loop, restoring, comparing and inspecting."""
