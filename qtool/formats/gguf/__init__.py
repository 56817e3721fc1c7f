"""llama.cpp's GGUF as a qtool format (not registered yet: the format registry wires it in).

- reader.GGUFFloatReader: any GGUF file as float tensors (the FloatReader protocol), under GGUF
  names, in torch order, quantized types dequantized as ggml does.
- summary.summarize: what `inspect` shows (architecture, key metadata, tensors, totals by type).
- names.pair_names / HFView: the GGUF's tensors under the names and in the layout of the
  Hugging Face checkpoint it was converted from (rotary permutation undone); what cannot be
  placed is listed.
- plan.choose and writer.write_quantized: a float GGUF (F32/F16/BF16) quantized tensor by
  tensor to GGUF types as llama-quantize writes them (its float-kept tensors, fallbacks, order,
  metadata and file type).
- ftype: llama.cpp's file types.
"""
