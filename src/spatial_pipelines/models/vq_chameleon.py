"""Meta Chameleon's VQGAN image tokenizer (encoder + decoder), as used by Anole and Lumina-mGPT.

transformers' ``ChameleonVQVAE`` ships the encoder only (no ``decode``); generation needs the decoder, so this module
implements the whole taming-transformers ``VQModel`` that Chameleon's ``vqgan.ckpt`` holds, plus converters from the
two public checkpoint layouts.

Verified against:

* Architecture: Meta's ``chameleon/inference/vqgan.py`` (taming-transformers' ``VQModel``). Encoder ``conv_in ->
  down[i].block[j] (+ down[i].attn[j] at attn_resolutions) -> down[i].downsample`` (pad right/bottom by 1, stride-2
  3x3 conv) ``-> mid.block_1, mid.attn_1, mid.block_2 -> norm_out, swish, conv_out``; decoder ``conv_in -> mid ->
  up[i]`` for ``i = L-1 .. 0`` with ``num_res_blocks + 1`` resnet blocks each, ``up[i].upsample`` (nearest x2 + 3x3
  conv) for ``i != 0`` ``-> norm_out, swish, conv_out`` (``up.0`` is the full-resolution level). GroupNorm(32,
  eps=1e-6) everywhere, resnet blocks without timestep projection, a 1x1 ``nin_shortcut`` when the width changes,
  single-head attention with scale ``C ** -0.5``; ``mid.attn_1`` always present. Quantiser ``VectorQuantizer2``: plain
  Euclidean nearest code (no L2 normalisation, unlike LlamaGen/Janus) between ``quant_conv`` and ``post_quant_conv``.
  Decoding is ``embedding[codes] -> post_quant_conv -> decoder``, pixels clamped to [-1, 1].
* Checkpoint layouts: transformers' ``convert_chameleon_weights_to_hf.py`` copies every non-decoder key of
  ``tokenizer/vqgan.ckpt`` verbatim under ``model.vqmodel.``, so the original key names ARE transformers'
  ``ChameleonVQVAE`` names, and maps the yaml's ``ch, out_ch, n_embed, ch_mult, double_z, z_channels`` to
  ``base_channels, out_channels, num_embeddings, channel_multiplier, double_latent, latent_channels``. The Anole port
  (transformers PR #32013, ``leloy/Anole-7b-v0.1-hf``) adds ``ChameleonVQVAEDecoder`` with the original names; a
  standalone VQ repo stores them without the ``model.vqmodel.`` prefix. Our module names are the original names, so
  both conversions are key-for-key after stripping a prefix.
* The yaml values (``n_embed 8192, embed_dim 256, z_channels 256, resolution 512, ch 128, ch_mult [1, 1, 2, 2, 4],
  num_res_blocks 2, attn_resolutions [], dropout 0``) agree with ``ChameleonVQVAEConfig``'s defaults; the yaml file
  itself (gated) was not available here.

Assumed, not verified: that the released ``vqgan.ckpt`` holds no keys besides the VQ model's (``loss.*`` training
weights are dropped; anything else is an error); that a standalone HF VQ repo's ``config.json`` uses
``ChameleonVQVAEConfig`` field names (missing fields take that class's defaults).
"""

import json
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from ..utils import CheckedSaveMixin
from ..weight_checks import CheckedLoadMixin, load_tensor_checkpoint
from .vq_blocks import AttnBlock, ResnetBlock, VQAutoencoderMixin, code_distances, decoder_stages, encoder_stages, vq_norm
from .vq_llamagen import VQEncoderOutput

#: Prefixes of training-only entries a taming-transformers checkpoint may carry (discriminator, LPIPS): dropped.
ORIGINAL_TRAINING_PREFIXES = ("loss.",)
#: Prefixes under which a transformers Chameleon/Anole model stores its VQ model.
HF_VQ_PREFIXES = ("model.vqmodel.", "vqmodel.")
#: ``ChameleonVQVAEConfig`` field -> (our config name, default of that class).
_HF_FIELDS = {
    "num_embeddings": ("codebook_size", 8192),
    "embed_dim": ("embed_dim", 256),
    "latent_channels": ("z_channels", 256),
    "base_channels": ("base_channels", 128),
    "channel_multiplier": ("channel_multiplier", (1, 1, 2, 2, 4)),
    "num_res_blocks": ("num_res_blocks", 2),
    "attn_resolutions": ("attn_resolutions", None),
    "resolution": ("resolution", 512),
    "in_channels": ("in_channels", 3),
    "out_channels": ("out_channels", 3),
    "dropout": ("dropout", 0.0),
}


class ChameleonVQMiddle(nn.Module):
    """The middle block: ``block_1``, ``attn_1``, ``block_2``."""

    def __init__(self, channels: int, groups: int, dropout: float):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, groups, dropout)
        self.attn_1 = AttnBlock(channels, groups)
        self.block_2 = ResnetBlock(channels, channels, groups, dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(h)))


class ChameleonVQEncoder(nn.Module):
    def __init__(self, in_channels, ch, ch_mult, num_res_blocks, z_channels, attn_resolutions, resolution, groups, dropout):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        attn = [resolution // 2**i in attn_resolutions for i in range(len(ch_mult))]  # level i works at resolution / 2^i
        self.down = encoder_stages(ch, ch_mult, num_res_blocks, attn, groups, dropout, "block")
        width = ch * ch_mult[-1]
        self.mid = ChameleonVQMiddle(width, groups, dropout)
        self.norm_out = vq_norm(width, groups)
        self.conv_out = nn.Conv2d(width, z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class ChameleonVQDecoder(nn.Module):
    def __init__(self, z_channels, ch, ch_mult, num_res_blocks, out_channels, attn_resolutions, resolution, groups, dropout):
        super().__init__()
        width = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, width, 3, padding=1)
        self.mid = ChameleonVQMiddle(width, groups, dropout)
        coarsest = resolution // 2 ** (len(ch_mult) - 1)
        attn = [coarsest * 2 ** (len(ch_mult) - 1 - i) in attn_resolutions for i in range(len(ch_mult))]
        levels = decoder_stages(ch, ch_mult, num_res_blocks + 1, attn, groups, dropout, "block")  # coarsest first
        self.up = nn.ModuleList(levels[::-1])  # indexed by level: up[0] is full resolution
        self.norm_out = vq_norm(ch * ch_mult[0], groups)
        self.conv_out = nn.Conv2d(ch * ch_mult[0], out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class ChameleonVQModel(CheckedLoadMixin, CheckedSaveMixin, ModelMixin, ConfigMixin, VQAutoencoderMixin):
    r"""Chameleon's VQGAN image tokenizer (Anole, Lumina-mGPT): 8192 codes of width 256, 16x downsampling.

    Module and parameter names are those of the original ``vqgan.ckpt`` (see the module docstring); load real weights
    with [`chameleon_vq_from_original`], [`chameleon_vq_from_hf`] or [`load_chameleon_vq`].

    Args:
        codebook_size (`int`), embed_dim (`int`): number of codes and their width (``n_embed``, ``embed_dim``).
        z_channels (`int`): encoder output / decoder input width (``z_channels``).
        base_channels (`int`), channel_multiplier (`tuple[int]`): trunk widths (``ch``, ``ch_mult``); there are
            ``len(channel_multiplier) - 1`` halvings.
        num_res_blocks (`int`): resnet blocks per encoder level (the decoder has one more per level).
        attn_resolutions (`tuple[int]`): feature-map sizes (counted from ``resolution``) whose levels get attention
            after every resnet block; empty for Chameleon, whose only attention is the middle block's.
        resolution (`int`): the nominal input size ``attn_resolutions`` refers to (512); any multiple of the
            downsampling factor is accepted at run time.
        in_channels (`int`), out_channels (`int`): image channels.
        dropout (`float`): resnet-block dropout (0 for the released weights).
        norm_num_groups (`int`): GroupNorm groups (32 in the original, hard-coded there).
    """

    @register_to_config
    def __init__(self, codebook_size: int = 8192, embed_dim: int = 256, z_channels: int = 256, base_channels: int = 128,
                 channel_multiplier: Sequence[int] = (1, 1, 2, 2, 4), num_res_blocks: int = 2,
                 attn_resolutions: Sequence[int] = (), resolution: int = 512, in_channels: int = 3,
                 out_channels: int = 3, dropout: float = 0.0, norm_num_groups: int = 32):
        super().__init__()
        ch_mult = tuple(int(m) for m in channel_multiplier)
        if not ch_mult or min(ch_mult) < 1:
            raise ValueError(f"`channel_multiplier` must be a non-empty sequence of positive ints, got {channel_multiplier!r}.")
        bad = [base_channels * m for m in ch_mult if (base_channels * m) % norm_num_groups]
        if norm_num_groups < 1 or bad:
            raise ValueError(f"`norm_num_groups`={norm_num_groups} must divide every level width, not {bad}.")
        attn = tuple(int(r) for r in (attn_resolutions or ()))
        g = norm_num_groups
        self.encoder = ChameleonVQEncoder(in_channels, base_channels, ch_mult, num_res_blocks, z_channels, attn, resolution, g, dropout)
        self.decoder = ChameleonVQDecoder(z_channels, base_channels, ch_mult, num_res_blocks, out_channels, attn, resolution, g, dropout)
        self.add_quantizer(codebook_size, embed_dim, z_channels, l2_norm=False)  # Euclidean nearest code, no normalisation

    @property
    def downsample_factor(self) -> int:
        """Pixels per code along each side (16 for Chameleon)."""
        return 2 ** (len(self.config.channel_multiplier) - 1)

    def encode(self, pixels: torch.Tensor) -> VQEncoderOutput:
        """Images ``(B, C, h, w)`` in [-1, 1] (``h, w`` multiples of `downsample_factor`) -> ``quant`` ``(B, d, H, W)``
        (straight-through) and ``indices`` ``(B, H, W)``: the nearest code in Euclidean distance (computed in fp32)."""
        if pixels.dim() != 4:
            raise ValueError(f"`pixels` must be (B, C, h, w), got shape {tuple(pixels.shape)}.")
        f = self.downsample_factor
        if pixels.shape[-2] % f or pixels.shape[-1] % f:
            raise ValueError(f"`pixels` height and width must be multiples of {f}, got {tuple(pixels.shape[-2:])}.")
        z = self.quant_conv(self.encoder(pixels)).permute(0, 2, 3, 1)  # (B, H, W, d)
        flat = z.reshape(-1, z.shape[-1]).float()
        indices = code_distances(flat, self.codebook.float()).argmin(dim=1).view(z.shape[:3])  # (B, H, W)
        z_q = z + (self.codebook[indices] - z).detach()  # straight-through
        return VQEncoderOutput(quant=z_q.permute(0, 3, 1, 2), indices=indices)

    def decode_code(self, codes: torch.Tensor) -> torch.Tensor:
        """Code grid ``(B, H, W)`` -> images ``(B, C, H * f, W * f)`` clamped to [-1, 1], in the model's dtype."""
        if codes.dim() != 3 or codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"`codes` must be an integer tensor (B, H, W), got {codes.dtype} {tuple(codes.shape)}.")
        size = self.config.codebook_size
        if codes.numel() and bool(((codes < 0) | (codes >= size)).any()):
            raise ValueError(f"`codes` must lie in [0, {size}), got values in [{int(codes.min())}, {int(codes.max())}].")
        quant = self.codebook[codes.to(self.codebook.device)].permute(0, 3, 1, 2)
        return self.decode(quant).clamp(-1.0, 1.0)

    def forward(self, pixels: torch.Tensor) -> Tuple[torch.Tensor, VQEncoderOutput]:
        """Round trip: returns ``(images, encoding)`` -- ``decode(encode(pixels).quant)`` clamped to [-1, 1], and the
        `encode` output (``.indices`` ``(B, H, W)``)."""
        enc = self.encode(pixels)
        return self.decode(enc.quant).clamp(-1.0, 1.0), enc


# ----------------------------------------------------------------------------------------------------------------------
# Conversion from the public checkpoint layouts
# ----------------------------------------------------------------------------------------------------------------------


def chameleon_vq_config_from_original(config: Mapping[str, Any]) -> Dict[str, Any]:
    """Our config from Chameleon's ``vqgan.yaml`` (parsed): the whole file, its ``model.params``, or that dict."""
    params = config.get("model", config)
    params = params.get("params", params)
    if "ddconfig" not in params:
        raise ValueError("`config` is not a taming VQGAN config: no `model.params.ddconfig` section.")
    dd = params["ddconfig"]
    required = ("ch", "out_ch", "ch_mult", "num_res_blocks", "attn_resolutions", "in_channels", "resolution", "z_channels")
    missing = [k for k in required if k not in dd] + [k for k in ("n_embed", "embed_dim") if k not in params]
    if missing:
        raise ValueError(f"`config` (vqgan.yaml) lacks {missing}.")
    if dd.get("double_z", True):  # taming's Encoder defaults to double_z=True (a KL posterior), not a VQ encoder
        raise ValueError("`config` has ddconfig.double_z true (or unset): not a VQ tokenizer encoder.")
    if dd.get("use_linear_attn", False) or dd.get("attn_type", "vanilla") != "vanilla":
        raise ValueError(f"`config` asks for attention {dd.get('attn_type', 'linear')!r}; only 'vanilla' is supported.")
    if params.get("remap") is not None:
        raise ValueError("`config` remaps code indices (`remap`), which this model does not support.")
    return dict(codebook_size=int(params["n_embed"]), embed_dim=int(params["embed_dim"]),
                z_channels=int(dd["z_channels"]), base_channels=int(dd["ch"]),
                channel_multiplier=tuple(int(m) for m in dd["ch_mult"]), num_res_blocks=int(dd["num_res_blocks"]),
                attn_resolutions=tuple(int(r) for r in dd["attn_resolutions"] or ()), resolution=int(dd["resolution"]),
                in_channels=int(dd["in_channels"]), out_channels=int(dd["out_ch"]),
                dropout=float(dd.get("dropout", 0.0)))


def chameleon_vq_config_from_hf(config: Any) -> Dict[str, Any]:
    """Our config from a transformers ``ChameleonVQVAEConfig`` (``model_type`` ``chameleon_vqgan``, a dict or the
    object) or a whole ``ChameleonConfig`` holding one as ``vq_config``."""
    config = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    if "vq_config" in config:
        config = dict(config["vq_config"] or {})
    model_type = config.get("model_type", "chameleon_vqgan")
    if model_type != "chameleon_vqgan":
        raise ValueError(f"`config` has model_type {model_type!r}, expected 'chameleon_vqgan'.")
    if config.get("double_latent", False):
        raise ValueError("`config` has double_latent true: not a VQ tokenizer encoder.")
    if config.get("attn_type", "vanilla") != "vanilla":
        raise ValueError(f"`config` has attn_type {config['attn_type']!r}; only 'vanilla' is supported.")
    out = {name: config.get(field, default) for field, (name, default) in _HF_FIELDS.items()}
    out["channel_multiplier"] = tuple(int(m) for m in out["channel_multiplier"])
    out["attn_resolutions"] = tuple(int(r) for r in out["attn_resolutions"] or ())
    return out


def _short(keys, limit: int = 25) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _load_strict(model: ChameleonVQModel, state_dict: Mapping[str, torch.Tensor], source: str) -> ChameleonVQModel:
    expected = model.state_dict()
    missing = set(expected) - set(state_dict)
    unexpected = set(state_dict) - set(expected)
    mismatched = [
        f"{k} (checkpoint {tuple(state_dict[k].shape)}, model {tuple(expected[k].shape)})"
        for k in sorted(set(expected) & set(state_dict))
        if tuple(state_dict[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing keys: {_short(missing)}")
            if all(k.startswith(("decoder.", "post_quant_conv.")) for k in missing):
                parts.append(
                    "(the checkpoint has no VQ decoder -- transformers' Chameleon conversions keep the encoder only; "
                    "convert the original tokenizer/vqgan.ckpt + vqgan.yaml, or an HF VQ repo with decoder weights)"
                )
        if unexpected:
            parts.append(f"unexpected keys: {_short(unexpected)}")
        if mismatched:
            parts.append(f"shape mismatches: {_short(mismatched)}")
        raise ValueError(f"{source} does not match ChameleonVQModel({dict(model.config)}): " + "; ".join(parts))
    model.load_state_dict(dict(state_dict), strict=True)
    return model.eval()


def _build(config: Dict[str, Any], norm_num_groups: Optional[int], torch_dtype: Optional[torch.dtype]) -> ChameleonVQModel:
    if norm_num_groups is not None:
        config = dict(config, norm_num_groups=norm_num_groups)
    model = ChameleonVQModel(**config)
    return model.to(torch_dtype) if torch_dtype is not None else model


def chameleon_vq_from_original(state_dict: Mapping[str, torch.Tensor], config: Optional[Mapping[str, Any]] = None, *,
                               norm_num_groups: Optional[int] = None,
                               torch_dtype: Optional[torch.dtype] = None) -> ChameleonVQModel:
    """A `ChameleonVQModel` from Chameleon's original ``vqgan.ckpt`` contents.

    Args:
        state_dict: the checkpoint's ``state_dict`` (or the whole checkpoint ``{"state_dict": ...}``), as
            ``torch.load(path, map_location="cpu", weights_only=True)`` returns it.
        config: the parsed ``vqgan.yaml``; ``None`` for the released tokenizer's configuration.
        norm_num_groups (`int`, *optional*): GroupNorm groups (the original hard-codes 32).
        torch_dtype: cast the model to this dtype.

    Raises `ValueError` listing missing, unexpected and wrongly-shaped keys (``loss.*`` training entries are dropped).
    """
    if "state_dict" in state_dict and isinstance(state_dict["state_dict"], Mapping):
        state_dict = state_dict["state_dict"]
    sd = {k: v for k, v in state_dict.items() if not k.startswith(ORIGINAL_TRAINING_PREFIXES)}
    cfg = chameleon_vq_config_from_original(config) if config is not None else {}
    return _load_strict(_build(cfg, norm_num_groups, torch_dtype), sd, "The original VQGAN checkpoint")


def chameleon_vq_from_hf(state_dict: Mapping[str, torch.Tensor], config: Any = None, *, norm_num_groups: Optional[int] = None,
                         torch_dtype: Optional[torch.dtype] = None) -> ChameleonVQModel:
    """A `ChameleonVQModel` from transformers-format weights: a standalone ``chameleon_vqgan`` repo (keys
    ``encoder.*``, ``decoder.*``, ``quantize.*`` ...) or a whole Chameleon/Anole model (keys under ``model.vqmodel.``;
    other keys are ignored then). ``config``: its ``config.json`` (dict or config object); ``None`` for defaults.

    Raises `ValueError` listing missing, unexpected and wrongly-shaped keys.
    """
    prefix = next((p for p in HF_VQ_PREFIXES if any(k.startswith(p) for k in state_dict)), None)
    sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)} if prefix else dict(state_dict)
    cfg = chameleon_vq_config_from_hf(config) if config is not None else {}
    return _load_strict(_build(cfg, norm_num_groups, torch_dtype), sd, "The transformers-format VQ checkpoint")


def _read_config(config: Union[None, str, Path, Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    if config is None or isinstance(config, Mapping):
        return config
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"`config` {str(path)!r} does not exist.")
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _read_hf_weights(folder: Path) -> Dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        binary = folder / "pytorch_model.bin"
        if binary.is_file():
            return load_tensor_checkpoint(binary, "source")  # tensors only: anything else is named, never unpickled
        raise ValueError(f"{str(folder)!r} has a config.json but no *.safetensors weights.")
    from safetensors import safe_open

    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            if any(k.startswith(HF_VQ_PREFIXES) for k in keys):  # a whole model: read only its VQ tensors
                keys = [k for k in keys if k.startswith(HF_VQ_PREFIXES)]
            out.update({k: f.get_tensor(k) for k in keys})
    return out


def load_chameleon_vq(source: Union[str, Path], config: Union[None, str, Path, Mapping[str, Any]] = None, *,
                      norm_num_groups: Optional[int] = None, torch_dtype: Optional[torch.dtype] = None) -> ChameleonVQModel:
    """Load Chameleon's VQGAN from a local path in any supported layout.

    ``source`` may be: the original ``vqgan.ckpt`` (``config``: its ``vqgan.yaml``, by default the ``.yaml`` beside
    it); a folder holding ``vqgan.ckpt`` + ``vqgan.yaml`` (or Chameleon's download root, with them under
    ``tokenizer/``); a transformers folder (``config.json`` with model_type ``chameleon_vqgan``, or a whole
    ``chameleon`` model whose ``vq_config`` and ``model.vqmodel.*`` weights are read) with safetensors weights; or a
    folder saved by `ChameleonVQModel.save_pretrained`.
    """
    path = Path(source)
    if not path.exists():
        raise ValueError(f"`source` {str(path)!r} does not exist.")
    if path.is_dir():
        for ckpt in (path / "vqgan.ckpt", path / "tokenizer" / "vqgan.ckpt"):
            if ckpt.is_file():
                return load_chameleon_vq(ckpt, config, norm_num_groups=norm_num_groups, torch_dtype=torch_dtype)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"`source` {str(path)!r} holds neither vqgan.ckpt nor a config.json.")
        cfg = _read_config(config) if config is not None else json.loads(config_file.read_text(encoding="utf-8"))
        if cfg.get("_class_name") == ChameleonVQModel.__name__:
            return ChameleonVQModel.from_pretrained(path, torch_dtype=torch_dtype)
        if cfg.get("model_type") not in ("chameleon_vqgan", "chameleon"):
            raise ValueError(f"{str(config_file)!r} has model_type {cfg.get('model_type')!r}, not 'chameleon_vqgan'.")
        return chameleon_vq_from_hf(_read_hf_weights(path), cfg, norm_num_groups=norm_num_groups, torch_dtype=torch_dtype)
    if config is None:
        config = path.with_suffix(".yaml")
        if not config.is_file():
            raise ValueError(f"`config` is needed: no {config.name} beside {str(path)!r}.")
    checkpoint = load_tensor_checkpoint(path, "source")
    return chameleon_vq_from_original(checkpoint, _read_config(config), norm_num_groups=norm_num_groups, torch_dtype=torch_dtype)


def tiny_chameleon_vq(num_codes: int = 16, seed: int = 0) -> ChameleonVQModel:
    """A tiny random `ChameleonVQModel` for tests (widths 8/16, ``downsample_factor`` 2, codes of width 4 drawn from
    N(0, 1) so codes decode differently). Weights are a function of ``seed`` alone; the global RNG is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ChameleonVQModel(
            codebook_size=num_codes, embed_dim=4, z_channels=8, base_channels=8, channel_multiplier=(1, 2),
            num_res_blocks=1, resolution=8, norm_num_groups=4,
        )
        nn.init.normal_(model.quantize.embedding.weight)
    return model.eval()
