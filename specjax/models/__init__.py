"""Qwen3/Llama-style decoder in Flax NNX, its KV cache, tokenizers and Hugging Face import."""

from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.decoder import Decoder, DecoderOutput
from specjax.models.hf import load_pretrained, load_tokenizer, save_pretrained
from specjax.models.tokenizer import CharTokenizer, HFTokenizer

__all__ = ["KVCache", "ModelConfig", "RopeScaling", "Decoder", "DecoderOutput", "CharTokenizer",
           "HFTokenizer", "load_pretrained", "load_tokenizer", "save_pretrained"]
