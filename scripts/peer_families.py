"""The families `peer_check.py` times, one small adapter each: how a layout's random model is built, the loop a user
of the family already runs (the peer), our pipeline class and the family's released sampling defaults.

An adapter builds the components our pipeline takes (``build``), names the trunk whose parameters are counted
(``trunk``), gives the prompts and sampling defaults, and runs its peer: ``peer(subject, prompts, n, temperature,
seed, compiled, warm) -> (codes (B, H*W), passes)``, ``n`` images per prompt as a batch of repeated prompts, sampling
unless ``temperature`` is 0, ``warm``: a short call that warms kernels and the allocator (a peer that compiles runs
whole). ``passes``: the peer's forward steps (one per generated token; the CFG rows advance in the same step).
"""

import abc
import contextlib
import copy
from typing import Dict, List, Optional, Tuple

import torch

from spatial_pipelines import DECODERS, AnolePipeline, Emu3Pipeline, JanusProPipeline, LlamaGenPipeline

#: the CPU layouts' Emu3 negative prompt is the released one (Emu3's image-generation example)
from spatial_pipelines.pipelines.pipeline_emu3 import EMU3_NEGATIVE_PROMPT


class Subject:
    """One layout's random model: its components, our pipelines over them (built once: ``{compiled: pipeline}``,
    the compiled one over a copy of the weights, as `enable_compile` compiles the trunk in place) and heads."""

    def __init__(self, family: "Family", layout: dict, components: dict, compile_backend: str):
        self.family, self.layout, self.components, self.compile_backend = family, layout, components, compile_backend
        self.pipes: Dict[bool, object] = {}
        self.heads: Dict[tuple, object] = {}
        self.tuned: Dict[tuple, dict] = {}  # (compiled, images per prompt) -> {decoder: the size `tune_decoder` picked, its time}
        self.sampling = family.sampling(layout)

    def pipe(self, compiled: bool):
        if compiled not in self.pipes:
            components = copy.deepcopy(self.components) if compiled else self.components
            pipe = self.family.pipeline_class(**components, decoder=DECODERS["ar"]())
            pipe.set_progress_bar_config(disable=True)
            if compiled:
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
                pipe.enable_compile(backend=self.compile_backend, keep_if_slower=True, measure=False)
            self.pipes[compiled] = pipe
        return self.pipes[compiled]

    @property
    def model(self):
        return self.components["transformer"]

    def prompts(self, texts: List[str]) -> List[str]:
        return self.family.prompts(self.layout, texts)

    def parameters(self) -> Dict[str, float]:
        trunk = sum(p.numel() for p in self.family.trunk(self.model).parameters())
        total = sum(p.numel() for c in self.components.values() if isinstance(c, torch.nn.Module) for p in c.parameters())
        return {"trunk_m": round(trunk / 1e6, 1), "total_m": round(total / 1e6, 1)}


class Family(abc.ABC):
    """A family's adapter; a subclass sets ``name`` and ``pipeline_class`` and writes every abstract method (one it
    forgets fails at instantiation)."""

    name: str
    pipeline_class: type
    #: whether the peer has a compiled row (``peer [compiled]``)
    compiled_peer: bool = False

    @abc.abstractmethod
    def build(self, layout: dict, device, dtype, natural_scale: bool) -> dict:
        """The model's components for ``layout``."""

    @abc.abstractmethod
    def sampling(self, layout: dict) -> dict:
        """The family's released sampling defaults."""

    @abc.abstractmethod
    def trunk(self, model) -> torch.nn.Module:
        """The language model trunk of ``model``."""

    def prompts(self, layout: dict, texts: List[str]) -> List[str]:
        return list(texts)

    @abc.abstractmethod
    def peer(self, subject: Subject, prompts, n: int, temperature: float, seed: int, compiled=False, warm=False):
        """The peer's codes for ``prompts`` (``n`` images each)."""

    def peer_text(self) -> str:
        """What the peer is, for the report (the class docstring from ``Peer:`` on, on one line)."""
        return " ".join(type(self).__doc__.split("Peer: ", 1)[-1].split())


def sample_kwargs(temperature: float, top_k: Optional[int]) -> dict:
    """transformers' ``generate`` sampling arguments (``top_k=0``: no top-k filter)."""
    return dict(do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=1.0) if temperature else dict(do_sample=False)


def natural_init(params, skip=lambda name: False) -> None:
    """Weights of std 1/sqrt(fan_in) (outputs then depend on the content: greedy checks mean something)."""
    with torch.no_grad():
        for name, param in params:
            if param.dim() == 2 and not skip(name):
                param.normal_(std=1.0 / param.shape[-1] ** 0.5)


# -- Janus-Pro -------------------------------------------------------------------------------------------------------
class Janus(Family):
    """Peer: transformers' ``JanusForConditionalGeneration.generate(..., generation_mode="image")`` as Janus-Pro's
    model card runs it (CFG as a doubled batch)."""

    name, pipeline_class = "janus", JanusProPipeline

    def sampling(self, layout):  # Janus-Pro's model card and generation config: CFG 5, temperature 1, all codes
        return dict(guidance_scale=5.0, temperature=1.0, top_k=None)

    def trunk(self, model):
        return model.model.language_model

    def build(self, layout, device, dtype, natural_scale):
        """A random `JanusForConditionalGeneration` of ``layout`` and its processor (a tiny tokenizer: the text
        vocabulary does not enter an image step); the vision tower and VQ decoder (not timed) kept small.
        ``natural_scale``: weights of std 1/sqrt(fan_in), else transformers' init (std 0.02: near-uniform codes)."""
        from transformers import JanusConfig, JanusForConditionalGeneration, JanusVisionConfig, JanusVQVAEConfig, LlamaConfig

        from spatial_pipelines.testing import tiny_janus_processor

        patch, grid, d = 4, layout["grid"], layout["hidden"]
        processor = tiny_janus_processor(grid * patch)
        tok = processor.tokenizer
        ids = {n: tok.convert_tokens_to_ids(t) for n, t in (("pad", "<pad>"), ("bos", "<bos>"), ("eos", "<eos>"),
                                                             ("boi", "<begin_of_image>"), ("image", "<image_placeholder>"))}
        text = LlamaConfig(vocab_size=len(tok), hidden_size=d, intermediate_size=layout["mlp"], num_hidden_layers=layout["layers"],
                           num_attention_heads=layout["heads"], num_key_value_heads=layout["kv_heads"], max_position_embeddings=4096,
                           bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
        vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, image_size=grid * patch,
                                   patch_size=patch, projection_dim=d, num_image_tokens=grid * grid)
        vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=layout["codes"], latent_channels=8, base_channels=32, channel_multiplier=[1, 1],
                              num_res_blocks=1, projection_dim=d, image_token_embed_dim=d, num_hidden_layers=2)
        config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=ids["image"])
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(device):
            model = JanusForConditionalGeneration._from_config(config, dtype=dtype).eval()
        if natural_scale:
            natural_init(model.named_parameters(), skip=lambda name: name.startswith("model.vision_model"))
            with torch.no_grad():
                model.model.language_model.embed_tokens.weight.normal_(std=1.0)
                model.model.generation_embeddings.weight.normal_(std=1.0)
        gen = model.generation_config
        gen.guidance_scale, gen.temperature, gen.do_sample = 5.0, 1.0, True
        gen.bos_token_id, gen.pad_token_id = ids["bos"], ids["pad"]
        gen.generation_kwargs = {"boi_token_id": ids["boi"]}
        return {"transformer": model, "processor": processor}

    def peer(self, subject, prompts, n, temperature, seed, compiled=False, warm=False):
        model, processor = subject.model, subject.components["processor"]
        backbone = subject.pipe(False).backbone
        inputs = processor(text=[backbone.prompt_text(p) for p in prompts for _ in range(n)], generation_mode="image",
                           padding=True, return_tensors="pt").to(model.device)
        torch.manual_seed(seed)
        with short_janus_image(model, 16) if warm else contextlib.nullcontext():
            codes = model.generate(**inputs, generation_mode="image", guidance_scale=subject.sampling["guidance_scale"],
                                   **sample_kwargs(temperature, None))
        return codes, codes.shape[1]  # one batched pass per code


@contextlib.contextmanager
def short_janus_image(model, num_codes: int):
    """Inside the block Janus' image generation emits ``num_codes`` codes (``num_image_tokens``, which it reads)."""
    config = model.model.vision_model.config
    full, config.num_image_tokens = config.num_image_tokens, num_codes
    try:
        yield
    finally:
        config.num_image_tokens = full


# -- Emu3 ------------------------------------------------------------------------------------------------------------
class Emu3(Family):
    """Peer: transformers' ``Emu3ForConditionalGeneration.generate`` as Emu3's documentation runs it: a
    ``prefix_allowed_tokens_fn`` allowing the visual tokens and forcing an EOL after every row, then EOF, EOI, EOS;
    CFG by ``guidance_scale`` with the negative prompt's ids (transformers' unbatched CFG processor)."""

    name, pipeline_class = "emu3", Emu3Pipeline

    def sampling(self, layout):
        # Emu3's image-generation example (CFG 3.0 with its negative prompt) and BAAI/Emu3-Gen's generation config
        # (top-k 2048, temperature 1): top-k 2048 kept at most the codebook
        return dict(guidance_scale=3.0, temperature=1.0, top_k=min(2048, layout["codes"]))

    def trunk(self, model):
        return model.model.text_model

    def build(self, layout, device, dtype, natural_scale):
        from spatial_pipelines.pipelines.pipeline_emu3 import configure_generation
        from spatial_pipelines.testing import dummy_emu3_components

        torch.manual_seed(0)
        components = dummy_emu3_components((layout["grid"],) * 2, layout["codes"], **trunk_kwargs(layout))
        configure_generation(components["transformer"], negative_prompt=EMU3_NEGATIVE_PROMPT)
        place(components["transformer"], device, dtype)
        return components

    def inputs(self, subject, texts):
        h, w = subject.pipe(False).backbone.image_grid
        out = subject.components["processor"](text=texts, return_for_image_generation=True, ratio=f"{w}:{h}",
                                              image_area=h * w * 64, padding=True, return_tensors="pt")
        assert out.pop("image_sizes") == [[h, w]] * len(texts)
        return out.to(subject.model.device)

    def peer(self, subject, prompts, n, temperature, seed, compiled=False, warm=False):
        model, tokenizer = subject.model, subject.components["processor"].tokenizer
        h, w = subject.pipe(False).backbone.image_grid
        inputs = self.inputs(subject, [p for p in prompts for _ in range(n)])
        negatives = self.inputs(subject, [EMU3_NEGATIVE_PROMPT] * inputs.input_ids.shape[0])
        visual, eol = model.vocabulary_mapping.image_tokens, model.vocabulary_mapping.eol_token_id
        tail = [tokenizer.eof_token_id, tokenizer.eoi_token_id, tokenizer.eos_token_id]

        def allowed(batch_id, input_ids):  # Emu3's own constraint: visual tokens, an EOL closing each row, the tail
            start = torch.nonzero(input_ids == tokenizer.image_wrapper_token_id, as_tuple=True)[0][0]
            offset = input_ids.shape[0] - start
            if offset > (w + 1) * h:
                return [tail[min(offset - (w + 1) * h - 1, 2)]]
            return [eol] if offset % (w + 1) == 0 else visual

        torch.manual_seed(seed)
        out = model.generate(**inputs, prefix_allowed_tokens_fn=allowed, guidance_scale=subject.sampling["guidance_scale"],
                             negative_prompt_ids=negatives.input_ids, negative_prompt_attention_mask=negatives.attention_mask,
                             max_new_tokens=16 if warm else (w + 1) * h + 3, **sample_kwargs(temperature, subject.sampling["top_k"]))
        generated = out[:, inputs.input_ids.shape[1]:]
        if warm:
            return generated, generated.shape[1]
        codes = model.vocabulary_mapping.convert_bpe2img(generated[:, :-3].reshape(-1, h, w + 1)).long()
        return codes.flatten(1), generated.shape[1]


def place(module, device, dtype):
    """``module`` on ``device`` in ``dtype`` (cast only when it is not in it: diffusers warns at every cast)."""
    module.to(device=device)
    return module if next(module.parameters()).dtype == dtype else module.to(dtype=dtype)


def trunk_kwargs(layout: dict) -> dict:
    return dict(hidden_size=layout["hidden"], num_layers=layout["layers"], num_heads=layout["heads"],
                num_kv_heads=layout["kv_heads"], intermediate_size=layout["mlp"])


# -- Anole / Chameleon -----------------------------------------------------------------------------------------------
class Anole(Family):
    """Peer: transformers' ``ChameleonForConditionalGeneration.generate`` on Chameleon's image prompt (``BOS text
    <reserved08706> <racm3:break>``, the processor's text turn plus begin-image), a ``prefix_allowed_tokens_fn``
    allowing the image tokens only, CFG by ``guidance_scale`` with the unconditional ids ``BOS <racm3:break>``.
    transformers' Chameleon forward sets every image-token logit to ``finfo.min`` (a text model there); for the call
    that mask is lifted, as image-generating forks of the model (Anole's, Lumina-mGPT's) do."""

    name, pipeline_class = "anole", AnolePipeline

    def sampling(self, layout):
        # AnolePipeline's default: text CFG 3.0 (Chameleon's guidance_scale_text, the scale LANTERN and ADT-Tree run
        # Anole at), temperature 1, no top-k
        return dict(guidance_scale=3.0, temperature=1.0, top_k=None)

    def trunk(self, model):
        return model.model

    def build(self, layout, device, dtype, natural_scale):
        from spatial_pipelines.testing import dummy_chameleon_components

        torch.manual_seed(0)
        components = dummy_chameleon_components((layout["grid"],) * 2, layout["codes"], **trunk_kwargs(layout))
        for name in ("transformer", "vqgan"):
            place(components[name], device, dtype)
        return components

    def peer(self, subject, prompts, n, temperature, seed, compiled=False, warm=False):
        model, processor = subject.model, subject.components["processor"]
        vocab = model.config.vocabulary_map
        h, w = model.generation_config.image_grid
        inputs = processor(text=[p for p in prompts for _ in range(n)], padding=True, return_tensors="pt")
        rows = inputs.input_ids.shape[0]
        input_ids = torch.cat([inputs.input_ids, torch.full((rows, 1), vocab["<racm3:break>"])], 1).to(model.device)
        mask = torch.cat([inputs.attention_mask, torch.ones(rows, 1, dtype=inputs.attention_mask.dtype)], 1).to(model.device)
        uncond = torch.tensor([[vocab["<s>"], vocab["<racm3:break>"]]] * rows, device=model.device)
        mapping = model.model.vocabulary_mapping
        image_ids = mapping.image_tokens
        torch.manual_seed(seed)
        with image_logits_unmasked(model):
            out = model.generate(input_ids=input_ids, attention_mask=mask, prefix_allowed_tokens_fn=lambda b, ids: image_ids,
                                 guidance_scale=subject.sampling["guidance_scale"], negative_prompt_ids=uncond,
                                 negative_prompt_attention_mask=torch.ones_like(uncond), max_new_tokens=16 if warm else h * w,
                                 **sample_kwargs(temperature, subject.sampling["top_k"]))
        generated = out[:, input_ids.shape[1]:]
        lookup = torch.zeros(max(mapping.bpe2img) + 1, dtype=torch.long)
        lookup[list(mapping.bpe2img)] = torch.tensor(list(mapping.bpe2img.values()))
        return lookup[generated.cpu()], generated.shape[1]


@contextlib.contextmanager
def image_logits_unmasked(model):
    """Inside the block the model's forward leaves the image-token logits as its head computes them (it masks the
    tokens its ``vocabulary_mapping.image_tokens`` lists: a copy listing none stands in)."""
    mapping = model.model.vocabulary_mapping
    lifted = copy.copy(mapping)
    lifted.image_tokens = []
    model.model.vocabulary_mapping = lifted
    try:
        yield
    finally:
        model.model.vocabulary_mapping = mapping


# -- LlamaGen --------------------------------------------------------------------------------------------------------
#: LlamaGen's class-conditional demo classes (``sample_c2i.py``)
LLAMAGEN_CLASSES = (207, 360, 387, 974, 88, 979, 417, 279)


class LlamaGen(Family):
    """Peer: `minimal_ar.minimal_ar_generate`, an independent gpt-fast-style AR loop over the same weights (eager, and
    compiled: its one-token decode step through `torch.compile`, ``reduce-overhead`` on CUDA); class-conditional."""

    name, pipeline_class, compiled_peer = "llamagen", LlamaGenPipeline, True

    def sampling(self, layout):  # LlamaGen's sample_c2i.py: --cfg-scale 4.0 --top-k 2000 --temperature 1.0
        return dict(guidance_scale=4.0, temperature=1.0, top_k=min(2000, layout["codes"]))

    def trunk(self, model):
        return model

    def prompts(self, layout, texts):  # class labels: LlamaGen's demo classes (modulo a tiny layout's classes)
        return [LLAMAGEN_CLASSES[i % len(LLAMAGEN_CLASSES)] % layout["classes"] for i in range(len(texts))]

    def build(self, layout, device, dtype, natural_scale):
        from spatial_pipelines import LlamaGenTransformer, PatchVQModel

        torch.manual_seed(0)
        transformer = LlamaGenTransformer(
            vocab_size=layout["codes"], hidden_size=layout["hidden"], num_layers=layout["layers"],
            num_attention_heads=layout["heads"], num_key_value_heads=layout["kv_heads"], intermediate_size=layout["mlp"],
            condition_type="class", num_classes=layout["classes"], num_condition_tokens=1, grid_height=layout["grid"],
            grid_width=layout["grid"], default_guidance_scale=4.0)
        natural_init(transformer.named_parameters())
        with torch.no_grad():
            transformer.tok_embeddings.weight.normal_(std=1.0)
            transformer.output.weight.normal_(std=0.5)
        vqvae = PatchVQModel(codebook_size=layout["codes"], patch_size=4)
        return {"transformer": place(transformer, device, dtype).eval(), "vqvae": vqvae.to(device=device).eval(),
                "text_encoder": None, "tokenizer": None}

    def peer(self, subject, prompts, n, temperature, seed, compiled=False, warm=False):
        from minimal_ar import minimal_ar_generate

        rows = [p for p in prompts for _ in range(n)]
        gens = [torch.Generator().manual_seed(seed + i) for i in range(len(rows))]
        s = subject.sampling
        codes = minimal_ar_generate(subject.pipe(False), rows, s["guidance_scale"], temperature, s["top_k"], gens,
                                    compile=compiled, compile_backend=subject.compile_backend).flatten(1)
        return codes, codes.shape[1]


FAMILIES: Dict[str, Family] = {f.name: f for f in (Janus(), Emu3(), Anole(), LlamaGen())}


def family_of(layout: dict) -> Family:
    return FAMILIES[layout["family"]]


def peer_rows(layout: dict, ours_compiled: bool) -> List[Tuple[str, bool]]:
    """The peer's rows ``(name, compiled)``: ``peer``, and ``peer [compiled]`` where the family has one and our
    compiled rows run."""
    return [("peer", False)] + ([("peer [compiled]", True)] if family_of(layout).compiled_peer and ours_compiled else [])
