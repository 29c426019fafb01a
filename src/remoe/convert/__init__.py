"""Converters between remoe checkpoints and transformers LLaMA / MoE ones (``remoe convert``).

* :mod:`remoe.convert.upcycle`: a dense model (ours or a transformers ``LlamaForCausalLM``)
  becomes an E-expert ReMoE whose experts are copies of the dense FFN;
* :mod:`remoe.convert.from_hf`: a transformers Mixtral, Qwen2-MoE or OLMoE becomes a ReMoE
  with its experts kept;
* :mod:`remoe.convert.to_hf`: a TopK ReMoE becomes a plain transformers Mixtral, Qwen2-MoE or
  OLMoE, a dense one a Llama, when lossless.

:mod:`remoe.convert.backbone` maps the shared LLaMA backbone (config fields, attention, norms,
embeddings); :mod:`remoe.convert.io` reads and writes the directories. See docs/CONVERT.md.
"""
