"""Independent references the tests compare against (no KV cache, no decoder)."""



import torch

from spatial_pipelines.core.sampling import SamplingConfig, cfg_mix, logits_to_probs

# Samples per chi-square distribution test (2x2 grid, 4 codes: 256 joint outcomes). Measured power at this size: AR
# samples at temperature 1.1 against the T=1 joint give p ~ 1e-41 (`test_distribution_test_detects_a_wrong_sampler`
# asserts p < 1e-4), a Medusa tree verified against a wrong q gives p ~ 0. 20,000 (before) cost 2.5x the time for no
# power those checks needed; the subtle negative controls in `test_jacobi.py` keep their own larger counts.
DISTRIBUTION_SAMPLES = 8000


def full_sequence_probs(pipe, prompts, sampling: SamplingConfig, prefixes: torch.Tensor) -> torch.Tensor:
    """Target distribution of the next code after each code prefix, recomputing the whole sequence (no cache).

    Args:
        prompts: one prompt per row of ``prefixes``.
        prefixes: ``(B, i)`` codes already generated.
    Returns:
        ``(B, V)`` fp32 probabilities.
    """
    backbone = pipe.backbone
    device = pipe.device
    prefix = backbone.encode_prompt(list(prompts), None, sampling.do_cfg, device)
    ids = prefixes.repeat(2, 1) if sampling.do_cfg else prefixes  # (R, i)
    codes = backbone.embed_image_tokens(ids)  # (R, i, D)
    layout = backbone.layout
    if layout.has_eol:  # the sequence the model was trained on: an EOL after every completed row
        eol = backbone.eol_embedding.expand(ids.shape[0], 1, -1)
        parts = []
        for j in range(ids.shape[1]):
            parts.append(codes[:, j : j + 1])
            if (j + 1) % layout.width == 0:
                parts.append(eol)
        codes = torch.cat(parts, 1) if parts else codes
    embeds = torch.cat([prefix.embeds, codes], dim=1)
    valid = torch.cat([prefix.valid, torch.ones_like(codes[..., 0], dtype=torch.bool)], dim=1)
    positions = torch.arange(embeds.shape[1], device=device)
    hidden = backbone.forward(embeds, positions, None, valid, None)  # (R, P + i, D)
    logits = backbone.image_logits(hidden[:, -1])  # (R, V)
    if sampling.do_cfg:
        logits = cfg_mix(logits, sampling.guidance_scale)
    return logits_to_probs(logits, sampling)


@torch.no_grad()
def naive_greedy(pipe, prompts, guidance_scale: float) -> torch.Tensor:
    """Greedy grids ``(B, H, W)`` by recomputing the full sequence for every code."""
    layout = pipe.backbone.layout
    sampling = SamplingConfig(guidance_scale=guidance_scale, temperature=0)
    tokens = torch.zeros(len(prompts), 0, dtype=torch.long)
    for _ in range(layout.num_tokens):
        probs = full_sequence_probs(pipe, prompts, sampling, tokens)
        tokens = torch.cat([tokens, probs.argmax(-1, keepdim=True)], dim=1)
    return layout.grid(tokens)


@torch.no_grad()
def exact_joint_distribution(pipe, prompt, sampling: SamplingConfig) -> torch.Tensor:
    """Probability of every code grid, by enumeration: ``(V ** (H*W),)`` indexed by the grid as a base-V number."""
    layout = pipe.backbone.layout
    v = pipe.backbone.num_image_codes
    probs = torch.ones(1)
    seqs = torch.zeros(1, 0, dtype=torch.long)
    for _ in range(layout.num_tokens):
        cond = full_sequence_probs(pipe, [prompt] * seqs.shape[0], sampling, seqs)  # (S, V)
        probs = (probs[:, None] * cond).reshape(-1)
        seqs = torch.cat(
            [seqs.repeat_interleave(v, dim=0), torch.arange(v).repeat(seqs.shape[0])[:, None]], dim=1
        )
    return probs


def grid_index(tokens: torch.Tensor, num_codes: int) -> torch.Tensor:
    """``(B, H, W)`` grids -> their index as base-``num_codes`` numbers (raster order, most significant first)."""
    flat = tokens.reshape(tokens.shape[0], -1)
    weights = num_codes ** torch.arange(flat.shape[1] - 1, -1, -1)
    return (flat * weights).sum(-1)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit, pooling the bins whose expected count is below ``min_expected``."""
    from scipy.stats import chisquare

    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)



