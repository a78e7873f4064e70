"""Integrations with other libraries (optional extras; each module imports its library lazily).

* :mod:`vispe.integrations.hf` -- any vispe multimodal position scheme in Hugging Face
  ``transformers`` Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and GLM-4V (dense and MoE), kept through
  ``save_pretrained`` / ``from_pretrained`` (``pip install "vispe[hf]"``); importing it imports ``transformers``
  and guards the supported classes' ``from_pretrained`` / ``save_pretrained`` (:mod:`vispe.integrations.hf_hub`).
"""
