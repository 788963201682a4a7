"""Test fixtures shared by several test files: heads that know the answer, the SSD schedule written out from the
method, and the Chameleon-family reference loop and checkpoint layout."""

import contextlib
import json
import shutil
from pathlib import Path

import torch

from spatial_pipelines import LatentDraftHeads
from spatial_pipelines.pipelines.transformers_utils import GROUPED_SDPA


def expected_passes(grid, num_horizontal=5, horizontal_rounds=1, vertical_rounds=2, num_vertical_rows=1,
                    staged_base_rounds=None, staged_incremental_rounds=None):
    """The schedule written out from the method description (not from the decoder's code)."""
    h, w = grid
    b = vertical_rounds if staged_base_rounds is None else staged_base_rounds
    i = vertical_rounds if staged_incremental_rounds is None else staged_incremental_rounds
    passes = 1  # prefill: code 0
    done = 1
    while done < w:  # first row: chunks of m drafts + the code drawn after them
        m = min(num_horizontal, w - done - 1)
        passes += horizontal_rounds + 1 if m else 1  # no drafts left to repair: one AR step
        done += m + 1
    rows_left = h - 1
    while rows_left > 0:
        g = min(num_vertical_rows, rows_left)
        passes += b + (g - 1) * (1 + i) + 1  # k_v = 1: r + 1
        rows_left -= g
    return passes


class OracleHeads(LatentDraftHeads):
    """Draft heads that know the answer: every draft is the code of a fixed grid (one-hot logits)."""

    def set_grid(self, grid: torch.Tensor):
        self.grid = grid.flatten(1)  # (B, N)

    def draft_logits(self, backbone, hidden_states, codes, direction, num_offsets, source_index=None):
        stride = 1 if direction == "horizontal" else self.config.grid_width
        offsets = torch.tensor(self.offsets(direction)[:num_offsets]) * stride  # (K,)
        target = (source_index[:, None] + offsets[None]).clamp_max(self.grid.shape[1] - 1)  # (n, K)
        return torch.nn.functional.one_hot(self.grid[:, target], backbone.num_image_codes).float() * 30  # (B, n, K, V)


def chameleon_code(name: str) -> int:
    """The code of an ``IMGIMG<letters>Z`` token (A..J are the digits 0..9)."""
    return int("".join(str(ord(c) - ord("A")) for c in name[6:-1]))


def code_ids_from_names(vocab):
    """code -> token id, parsed from the ``IMGIMG<letters>Z`` names."""
    codes = {chameleon_code(name): i for name, i in vocab.items() if name.startswith("IMGIMG")}
    return torch.tensor([codes[c] for c in range(len(codes))])


@contextlib.contextmanager
def transformers_sdpa(model):
    """Inside the block, ``model``'s trunk runs transformers' own ``sdpa`` attention (keys and values repeated to every
    query head) where a pipeline switched it to the library's grouped attention: the references run the model as
    transformers does."""
    configs = {id(m.config): m.config for m in model.modules()
               if getattr(getattr(m, "config", None), "_attn_implementation", None) == GROUPED_SDPA}
    for config in configs.values():
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        for config in configs.values():
            config._attn_implementation = GROUPED_SDPA


# -- the reference: a plain loop over the transformers model ---------------------------------------------------------
@torch.no_grad()
def chameleon_reference_greedy(pipe, prompts, guidance_scale, negative_prompts=None, lumina=False, eol=True):
    """Greedy grids ``(B, H, W)`` from the transformers model alone, by full recompute (no cache): the sequence is
    written out token by token from the family's format (token names looked up in the model's vocabulary), each step
    runs ``model.model`` on the whole sequence and ``lm_head`` on its last (post-norm) state, restricted to the image
    columns; CFG mixes the conditional and unconditional rows' raw logits. Lumina-mGPT: ``<racm3:break> res_h res_w``
    after the turn (``<reserved{8800 + pixels / patch}>``), an EOL after every finished row (``eol=False`` drops them,
    as a control), the unconditional row ``<racm3:break> res_h res_w`` without BOS or text."""
    model, tokenizer = pipe.transformer, pipe.backbone.tokenizer
    vocab = model.config.vocabulary_map
    h, w = model.generation_config.image_grid
    code_ids = code_ids_from_names(vocab)
    start = [vocab["<racm3:break>"]]
    if lumina:
        f, patch = pipe.vqgan.downsample_factor, model.generation_config.resolution_patch_size
        start += [vocab[f"<reserved{8800 + h * f // patch:05d}>"], vocab[f"<reserved{8800 + w * f // patch:05d}>"]]

    def turn(text):
        if lumina:
            text = f"Generate an image of {w * f}x{h * f} according to the following prompt:\n{text}"
        return [vocab["<s>"], *tokenizer(text, add_special_tokens=False).input_ids, vocab["<reserved08706>"], *start]

    grids = []
    for i, prompt in enumerate(prompts):
        rows = [turn(prompt)]
        if guidance_scale != 1.0:
            rows.append(turn(negative_prompts[i]) if negative_prompts else ([] if lumina else [vocab["<s>"]]) + start)
        codes = []
        for j in range(h * w):
            with transformers_sdpa(model):
                hidden = [model.model(input_ids=torch.tensor([r]), use_cache=False).last_hidden_state[:, -1] for r in rows]
            logits = [model.lm_head(x)[0, code_ids] for x in hidden]  # post-norm state -> image columns
            mixed = logits[1] + guidance_scale * (logits[0] - logits[1]) if len(rows) == 2 else logits[0]
            code = int(mixed.argmax())
            codes.append(code)
            for r in rows:
                r.append(int(code_ids[code]))
                if lumina and eol and (j + 1) % w == 0 and j + 1 < h * w:
                    r.append(vocab["<reserved08799>"])
        grids.append(torch.tensor(codes).reshape(h, w))
    return torch.stack(grids)


def write_transformers_repo(pipe, folder):
    """The layout of ``leloy/Anole-7b-v0.1-hf``: config.json + safetensors + generation_config.json + processor and
    tokenizer files, no model_index.json, no VQ decoder."""
    pipe.transformer.save_pretrained(folder)
    pipe.processor.save_pretrained(folder)
    config = json.loads((folder / "generation_config.json").read_text())
    for key in ("image_grid", "guidance_scale", "resolution_patch_size"):
        config.pop(key, None)
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert not (folder / "model_index.json").exists()
    return folder


# -- Hub cache, offline, by repo id and revision --------------------------------------------------------------
def lay_out_hub_cache(hub: Path, repo_id: str, folder: Path, commit: str, refs=("main",)) -> None:
    """A repo in the Hub cache as huggingface_hub lays it out: ``models--org--name/snapshots/<commit>/`` and
    ``refs/<name>`` files holding the commit."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)


def tiny_pipeline_with_every_heads():
    """A tiny random LlamaGen pipeline (no heads attached) and random heads of every kind a registered decoder drafts
    with, ``{kind: heads}`` (the demo's tests serve every decoder from them)."""
    from spatial_pipelines.decoders import DECODERS
    from spatial_pipelines.testing import dummy_pipeline, random_draft_heads

    pipe = dummy_pipeline("llamagen")
    heads = {}
    for cls in DECODERS.values():
        need = cls().heads_needed()
        if need is not None and need.kinds[0] not in heads:
            heads[need.kinds[0]] = random_draft_heads(pipe, cls())
    pipe.set_draft_heads(None)
    return pipe, heads


def record_device_loops(monkeypatch, pipe) -> list:
    """The `DeviceLoop` of every call of ``pipe`` from now on, in a list."""
    loops = []
    run_device = pipe.loop._run_device

    def recorded(loop, *args, **kwargs):
        loops.append(loop)
        return run_device(loop, *args, **kwargs)

    monkeypatch.setattr(pipe.loop, "_run_device", recorded)
    return loops
