"""The generation loop (`GenerationLoop`): from the encoded prompts to the token grids, for every family and decoder.

The loop owns what runs between the prompt encoder and the VQ decoder: the KV cache, the prompt pass, the rounds
(whole on the device, `device_loop`, or in row groups with every decoder's own `propose` and `step`, `rows`), the
padding to fixed shapes (`static_shapes`), the compiled step and round, and how often the host reads the device. The
pipeline (`SpatialARPipeline`) checks the inputs, encodes the prompts, VQ-decodes the grids and runs diffusers'
progress bar and callbacks through `LoopHooks`; it builds its loop once, beside its backbone adapter.

One call, as numbered steps (`GenerationLoop.generate`)::

    3. the KV cache and one state per image (its seed, its cursor)
    4. the prompt pass: its last output gives each row's first code
    5. rounds until every grid is full:
       a. propose a draft per row  b. end-of-row tokens  c. one target forward  d. CFG mix
       e. accept and commit each row's run  f. keep each row's accepted path in the cache
"""

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from ..core.kv_cache import StaticKVCache, varying_length_attention
from ..core.sampling import SamplingConfig, cfg_mix, draw_seeds
from ..decoders.decoding_utils import DecodingState, RowsDiverged, SpatialDecoderMixin, StepOutput, split_rows
from ..utils import NULL_TIMER, RoundTimer, check_number
from .backbone import PromptEmbeddings, SpatialBackbone
from .compiled import eager_target, mark_static_cache, uses_cuda_graphs
from .device_chain import ChainLoop
from .device_loop import MAX_ROUNDS_PER_SYNC, DeviceLoop, RoundView, compile_round
from .device_ssd import SSDLoop
from .device_tree import DynamicTreeLoop, HeadTreeLoop, TreeLoop
from .pass_cost import PassCost
from .pipeline_output import DecodingStats
from .rows import FedGroup, Kept, RowBatch, insert_end_of_rows, split_group, stack_groups
from .static_shapes import RECOMPILE_LIMIT, pad_fed, static_cache_length

#: `GenerationLoop.compile` keeps the compiled step unless its passes (1 and 8 fed tokens) take more than this much
#: longer than the eager ones: the round compiled around it also drops the eager ops between passes, which that
#: timing does not see (on the 2-core EPYC VM the passes tie while a compiled round is 1.07-1.31x faster per image)
COMPILE_TOLERANCE = 0.05


@contextlib.contextmanager
def _no_progress_bar(total: int = 0):
    class _Bar:
        n = 0

        def update(self, k: int) -> None:
            self.n += k

    yield _Bar()


@dataclass
class LoopHooks:
    """What the pipeline runs inside a generation: diffusers' progress bar and callback contract.

    Args:
        progress_bar (`Callable`): ``progress_bar(total=...)``, a context manager yielding a bar with ``update(k)`` and
            ``n`` (`DiffusionPipeline.progress_bar`); it counts codes over the batch.
        on_round (`Callable`, *optional*): ``on_round(step_index, view)`` after every round, ``view`` showing every row's
            grid (``tokens``, ``acceptance_map``, ``num_committed``, ``finished``, ``sampling``: `device_loop.RoundView`
            or the row-group loop's `RowBatch`) (``callback_on_step_end``). The host reads the device after every round
            while it is set.
        interrupted (`Callable`): ``interrupted()`` is checked before every row-group round (``pipe.interrupt``).
        rounds_known (`Callable`): ``rounds_known(n)``: the rounds known so far, those run and one more while a grid is
            not full (``pipe.num_timesteps``; a callback finds its last step as ``step_index == num_timesteps - 1``).
    """

    progress_bar: Callable[..., ContextManager] = _no_progress_bar
    on_round: Optional[Callable[[int, Any], None]] = None
    interrupted: Callable[[], bool] = lambda: False
    rounds_known: Callable[[int], None] = lambda n: None


class GenerationLoop:
    r"""Prefill, rounds, KV cache, fixed shapes, compile and sync cadence of a pipeline's generations.

    Built once per pipeline over its backbone adapter (`SpatialARPipeline.loop`); the decoder and heads come with each
    call (they are swappable). Its settings are the pipeline's (`SpatialARPipeline.static_shapes`, ``device_rounds``,
    ``max_rounds_per_sync``).

    Args:
        backbone (`SpatialBackbone`): the family adapter.
    """

    def __init__(self, backbone: SpatialBackbone):
        self.backbone = backbone
        self.static_shapes_setting: Optional[bool] = None  # None: on when compiled
        self.device_rounds: Optional[bool] = None  # False: always the row-group loop
        self.max_rounds_per_sync: int = MAX_ROUNDS_PER_SYNC
        self.timer: Optional[RoundTimer] = None  # a RoundTimer while `profile_rounds` is active
        # what one call runs with (`generate` sets them)
        self.decoder: Optional[SpatialDecoderMixin] = None
        self.draft_heads = None
        self.hooks = LoopHooks()

    def settings(self) -> Dict[str, Any]:
        """The user's settings, carried over when a copied pipeline builds its own loop."""
        return {"static_shapes_setting": self.static_shapes_setting, "device_rounds": self.device_rounds,
                "max_rounds_per_sync": self.max_rounds_per_sync}

    @property
    def static_shapes(self) -> bool:
        return self.is_compiled if self.static_shapes_setting is None else self.static_shapes_setting

    # -- one generation -----------------------------------------------------------------------------------
    def generate(self, decoder: SpatialDecoderMixin, draft_heads, prefix: PromptEmbeddings, sampling: SamplingConfig,
                 generator, batch_size: int, hooks: Optional[LoopHooks] = None) -> Tuple[torch.Tensor, DecodingStats]:
        """Steps 3-5 for ``batch_size`` images of the prompt rows ``prefix`` ``(R, P, D)``: rounds whole on the device
        where the decoder and settings allow (`device_plan`), else in row groups. Returns the grids ``(B, N)`` in raster
        order and the `DecodingStats` (read from the device after the last round)."""
        self.decoder, self.draft_heads, self.hooks = decoder, draft_heads, hooks or LoopHooks()
        try:
            plan = self.device_plan(sampling, batch_size, prefix.embeds.device)
            if plan is not None:
                return self._generate_on_device(prefix, sampling, generator, batch_size, plan)
            return self._generate_groups(prefix, sampling, generator, batch_size)
        finally:
            self.decoder, self.draft_heads, self.hooks = None, None, LoopHooks()

    def device_plan(self, sampling: SamplingConfig, batch_size: int, device: torch.device) -> Optional[Tuple[type, Dict[str, Any]]]:
        """The loop whose rounds run whole on the device (`device_loop`) and its arguments, or ``None`` for the
        row-group loop: a chain decoder (`SpatialDecoderMixin.chain_window`), or a tree decoder's drafter
        (`SpatialDecoderMixin.device_drafter`: a static head tree, or a tree grown per row; with end-of-row tokens, a
        tree shallower than a row), exact, or with a relaxed acceptance rule (LANTERN, LANTERN++: `relaxed_chain`,
        `device_tree.relaxed_matches`). Every random draw comes from keyed streams of a seed each image draws from its
        generator: under keyed noise (or greedy) a draft is accepted when it equals the target's keyed sample (AR's
        image); under drawn noise a chain keeps its drafts' proposals and accepts by speculative sampling, and a tree
        of distinct point-mass candidates by the parent's sample, which is that test for point masses. A decoder whose
        passes are known before the first (SSD: `SpatialDecoderMixin.device_schedule`) runs them in lockstep
        (`device_ssd.SSDLoop`). ``device_rounds`` ``False`` turns it off."""
        decoder = self.decoder
        relaxed = decoder.lossless and decoder.acceptance_rule.relaxes  # LANTERN, LANTERN++: seeds from the generators
        drawn = not (sampling.keyed or sampling.greedy)  # speculative sampling on keyed streams of the rows' seeds
        if self.device_rounds is False:
            return None
        schedule = decoder.device_schedule(self.backbone.layout)
        if schedule is not None:  # passes known before the first (SSD): the rows run them in lockstep
            return SSDLoop, {"schedule": schedule, "draft_heads": self.draft_heads}
        if not (decoder.is_exact or relaxed):
            return None
        rule = decoder.acceptance_rule
        acceptance = {}
        if relaxed:
            acceptance = {"rule": rule, "neighbours": self.backbone.code_neighbours(rule.num_neighbours) if rule.num_neighbours else None}
        window = decoder.chain_window(drawn=drawn)
        if window is not None:
            return ChainLoop, {"window": window, "proposals": drawn, **decoder.chain_drafting(self.draft_heads), **acceptance}
        layout = self.backbone.layout
        if relaxed and not rule.claims_neighbours:  # a claim no sample of p decides (`relaxed_matches`)
            return None
        drafter = decoder.device_drafter(self.draft_heads, layout, batch_size, device)
        if drafter is None or not TreeLoop.fits(layout, drafter.tree_depth):  # a round crosses one row end at most
            return None
        return (DynamicTreeLoop if getattr(drafter, "per_row_trees", False) else HeadTreeLoop), {"drafter": drafter, **acceptance}

    # -- rounds on the device -------------------------------------------------------------------------------
    def _generate_on_device(self, prefix: PromptEmbeddings, sampling: SamplingConfig, generator, batch_size: int,
                            plan: Tuple[type, Dict[str, Any]]) -> Tuple[torch.Tensor, DecodingStats]:
        """Steps 3-5 by a `DeviceLoop`: the cache, the prompt pass, then rounds on the device with a host read per
        sync (the progress bar moves at each)."""
        loop_class, kwargs = plan
        backbone = self.backbone
        layout, rows = backbone.layout, prefix.embeds.shape[0]
        # 3. one noise seed per image, the KV cache, the round (compiled whole when the step is)
        seeds = torch.zeros(batch_size, dtype=torch.long) if sampling.greedy else draw_seeds(generator, batch_size)
        fed = loop_class.fed_slots(layout, **kwargs)
        cache = self.make_cache(rows, prefix.embeds.shape[1] + layout.sequence_length + fed, prefix.embeds.device)
        round_fn = self._compiled_device_round(loop_class.default_round())
        loop = loop_class(backbone, sampling=sampling, seeds=seeds, prefix=prefix, cache=cache, round_fn=round_fn, **kwargs)
        loop.max_rounds_per_sync = self.max_rounds_per_sync
        if self.timer is not None:  # `profile_rounds`: the parts of an eager round, every round and read
            loop.host_timer, loop.timer = self.timer, (self.timer if round_fn is None else loop.timer)
        # 4. the prompt pass
        loop.prefill(prefix)
        # 5. rounds, the host reading the device once per sync (after every round while a step callback is set)
        with self.hooks.progress_bar(total=layout.num_tokens * batch_size) as progress_bar:
            rounds = self._run_device(loop, lambda done: progress_bar.update(done - progress_bar.n))
        if self.timer is not None:
            self.timer.rounds += rounds
        self.hooks.rounds_known(rounds)
        return loop.grid_tokens(), self._device_stats(loop, rounds, batch_size)

    def _run_device(self, loop: DeviceLoop, on_sync: Callable[[int], None]) -> int:
        """Step 5 on the device (`DeviceLoop.run`) with the call's hooks: a step callback sees every round (`RoundView`),
        ``pipe.num_timesteps`` is the rounds run plus one while a grid is not full, ``pipe.interrupt`` stops the rounds;
        returns the rounds run."""
        hooks = self.hooks
        on_round = None
        if hooks.on_round is not None:
            def on_round(index: int, slowest: int) -> None:
                view = RoundView(loop, slowest)
                hooks.rounds_known(index + 1 + (0 if view.finished else 1))
                hooks.on_round(index, view)
        return loop.run(on_sync, on_round, hooks.interrupted)

    def _device_stats(self, loop: DeviceLoop, rounds: int, batch_size: int) -> DecodingStats:
        """What a device generation cost: one host read of the per-pass accepted lengths, after the last round."""
        layout = self.backbone.layout
        accepted = loop.accepted_lengths()  # (passes, B)
        row_passes = loop.row_passes(accepted)
        fed = rounds * batch_size * loop.fed
        return DecodingStats(
            num_forward_passes=1 + rounds, num_draft_passes=loop.draft_passes(rounds),
            num_tokens=batch_size * layout.num_tokens,
            mean_accepted_length=accepted.sum().item() / max(sum(row_passes), 1), accepted_lengths=accepted.cpu(),
            acceptance_map=layout.grid(loop.state.acceptance_map[:, :-1]).cpu(), wall_time_s=0.0,
            padded_fraction=1 - sum(p - 1 for p in row_passes) * loop.fed / fed if fed else None,  # finished rows' slots
            row_forward_passes=row_passes, decoder_stats=loop.report())

    # -- rounds in row groups -------------------------------------------------------------------------------
    def _generate_groups(self, prefix: PromptEmbeddings, sampling: SamplingConfig, generator,
                         batch_size: int) -> Tuple[torch.Tensor, DecodingStats]:
        """Steps 3-5 in row groups (`RowBatch`): every decoder's own `propose` and `step`."""
        start_time = time.perf_counter()
        # 3. one typed decoder state per image (its random numbers, its cursor) and the KV cache
        batch, cache = self._prepare(prefix, sampling, generator, batch_size)
        # 4. the prompt pass predicts each row's first code
        self._prefill(prefix, batch, cache)
        # 5. rounds: propose -> target forward -> CFG mix -> decoder step -> commit to the KV cache (`_round`), every
        #    row at its own pace until every grid is full
        num_forward_passes = 1 + self._rounds(batch, cache)
        return batch.tokens, self._stats(batch, num_forward_passes, batch_size, start_time)

    def _prepare(self, prefix: PromptEmbeddings, sampling: SamplingConfig, generator,
                 batch_size: int) -> Tuple[RowBatch, StaticKVCache]:
        """Step 3: one typed decoder state per image with its random numbers (`RowBatch`), and the KV cache."""
        backbone, layout, device = self.backbone, self.backbone.layout, prefix.embeds.device
        prefix_length = prefix.embeds.shape[1]
        batch = RowBatch.create(self.decoder, layout, sampling, generator, batch_size, prefix_length, device, backbone)
        max_fed = self.decoder.max_fed_tokens(layout) * (2 if layout.has_eol else 1)  # an EOL may follow every fed code
        cache = self.make_cache(prefix.embeds.shape[0], prefix_length + layout.sequence_length + max_fed, device)
        batch.fed_size = max_fed if cache.fixed_shape else None  # every round feeds this many slots (static shapes)
        return batch, cache

    def _prefill(self, prefix: PromptEmbeddings, batch: RowBatch, cache: StaticKVCache) -> None:
        """Step 4: one pass over the prompt fills the cache; its last output gives each row's first code. After it,
        several images keep one cache length per row (`StaticKVCache.track_rows`): each advances on its own."""
        backbone, decoder, sampling = self.backbone, self.decoder, batch.sampling
        positions = torch.arange(prefix.embeds.shape[1], device=prefix.embeds.device)
        with eager_target(backbone.target_module):  # the prompt's length varies: never a compiled graph per length
            hidden = backbone.forward(prefix.embeds, positions, None, prefix.valid, cache)  # (R, P, D)
        logits = backbone.image_logits(hidden[:, -1:])  # (R, 1, V) fp32
        logits = cfg_mix(logits, sampling.guidance_scale) if sampling.do_cfg else logits  # (B, 1, V)
        if len(batch.groups) == 1:  # every row in one state: no indexing
            rows = hidden.shape[0] if decoder.uses_all_rows else batch.batch_size
            decoder.step(logits, hidden[:rows, -1:], None, batch.groups[0].state, self.draft_heads, backbone)
        else:
            for g in batch.groups:
                decoder.step(logits[g.index], hidden[self._hidden_rows(g.index, batch, hidden.shape[0]), -1:], None,
                             g.state, self.draft_heads, backbone)
        if batch.batch_size > 1:
            cache.track_rows()

    def _rounds(self, batch: RowBatch, cache: StaticKVCache) -> int:
        """Step 5: rounds until every row's grid is full, with the progress bar (codes of every row) and the per-round
        hook; returns how many."""
        timer, hooks = self.timer or NULL_TIMER, self.hooks
        rounds = 0
        with hooks.progress_bar(total=self.backbone.layout.num_tokens * batch.batch_size) as progress_bar:
            progress_bar.update(batch.total_committed)
            while not batch.finished and not hooks.interrupted():
                committed_before = batch.total_committed
                with timer.section("round"):
                    self._round(batch, cache, timer)
                timer.rounds += 1
                rounds += 1
                hooks.rounds_known(rounds + (0 if batch.finished else 1))
                progress_bar.update(batch.total_committed - committed_before)
                if hooks.on_round is not None:
                    batch.sync()  # the callback sees every row's grid
                    hooks.on_round(rounds - 1, batch)
                    batch.write_back()
        hooks.rounds_known(rounds)
        batch.sync()
        return rounds

    def _round(self, batch: RowBatch, cache: StaticKVCache, timer) -> None:
        """Step 5, one round: a-f below, over every group of rows not yet finished (`RowBatch`). Each part runs inside
        ``timer.section`` (see `profile_rounds`). One image takes `_round_one` (the same steps on one shared length)."""
        if batch.batch_size == 1:
            return self._round_one(batch.groups[0].state, batch, cache, timer)
        backbone, layout, sampling = self.backbone, batch.layout, batch.sampling
        active = batch.active()
        # 5a. every group proposes its draft at its own cursor (its last committed code first)
        with timer.section("draft"):
            drafts = [self.decoder.propose(g.state, self.draft_heads, backbone) for g in active]
        # 5b. end-of-row tokens are forced, never drafted: one after every fed code that ends a row
        with timer.section("eol"):
            fed = [insert_end_of_rows(layout, g.state, draft, g) for g, draft in zip(active, drafts)]
        # 5c. one target forward over every row's draft, padded to one width (CFG rows as one batch)
        with timer.section("forward"):
            hidden = self._forward_groups(fed, batch, cache)  # (R, F, D)
            logits = backbone.image_logits(hidden)  # (R, F, V) fp32
        # 5d-e. CFG mix; each group accepts its rows' runs and commits them (splitting rows that diverge)
        with timer.section("accept"):
            logits = cfg_mix(logits, sampling.guidance_scale) if sampling.do_cfg else logits  # (B, F, V)
            kept: List[Kept] = [0] * batch.batch_size  # a finished row keeps nothing
            for f in fed:
                self._step_group(batch, f, logits, hidden, kept)
        # 5f. each row keeps its own accepted path in the KV cache (with the EOLs that follow its row ends)
        with timer.section("kv"):
            cache.keep_rows(kept + kept if sampling.do_cfg else kept)

    def _forward_groups(self, fed: List[FedGroup], batch: RowBatch, cache: StaticKVCache) -> torch.Tensor:
        """Step 5c for several groups: their drafts placed at their rows, padded to one width, one target pass."""
        backbone, sampling = self.backbone, batch.sampling
        widest = max(f.width for f in fed)
        width = widest if batch.fed_size is None else batch.fed_size
        if width < widest:
            raise ValueError(f"A round fed {widest} tokens, more than the {width} the decoder declared (`max_draft_tokens`).")
        batch.fed_slots += width * batch.batch_size
        batch.padded_slots += width * batch.batch_size - sum(f.width * len(f.group.rows) for f in fed)
        ids, position_ids, mask, is_eol = stack_groups(fed, batch, width, batch.tokens.device)  # (B, F), (B, F), (B, F, F), (B, F)
        if sampling.do_cfg:  # the unconditional rows verify the same drafts
            ids, position_ids, mask = ids.repeat(2, 1), position_ids.repeat(2, 1), mask.repeat(2, 1, 1)
        embeds = backbone.embed_image_tokens(ids)  # (R, F, D)
        if is_eol is not None and any(f.eol is not None for f in fed):
            eol_slots = is_eol.repeat(2, 1) if sampling.do_cfg else is_eol
            embeds = torch.where(eol_slots[..., None], backbone.eol_embedding.to(embeds.dtype), embeds)
        return self.target_forward(embeds, position_ids, mask, cache)  # (R, F, D)

    def _step_group(self, batch: RowBatch, fed: FedGroup, logits: torch.Tensor, hidden: torch.Tensor, kept: List[Kept]) -> None:
        """Step 5e for one group: the decoder accepts and commits its rows' runs. Rows that accepted runs of different
        lengths (`RowsDiverged`, raised before the state changed) are split into one group per run length, each
        stepped with the verification already drawn. Records what each row keeps of its fed slots in ``kept``."""
        g, t, decoder, backbone = fed.group, fed.width, self.decoder, self.backbone
        if g.rows == list(range(batch.batch_size)):  # every row, in order: plain slices
            row_logits = logits[:, :t]
            row_hidden = hidden[:, :t] if decoder.uses_all_rows else hidden[: batch.batch_size, :t]
        else:
            row_logits, row_hidden = logits[g.index, :t], hidden[self._hidden_rows(g.index, batch, hidden.shape[0]), :t]
        if fed.eol is not None:  # a row's last code sees its EOL's output
            row_logits, row_hidden = fed.eol.outputs(row_logits), fed.eol.outputs(row_hidden)  # (n, T, V), (n or 2n, T, D)
        try:
            result = decoder.step(row_logits, row_hidden, fed.draft, g.state, self.draft_heads, backbone)
            _record_kept(kept, g.rows, result, fed.eol, t)
            return
        except RowsDiverged as error:
            diverged = error  # `except` unbinds its name on leaving the block
        parts = split_group(g, diverged.runs)
        batch.replace(g, [part for _, part in parts])
        n = len(g.rows)
        for local, part in parts:
            index = torch.tensor(local, device=row_logits.device)
            twins = torch.cat([index, index + n]) if row_hidden.shape[0] == 2 * n else index
            accepted, prefix = diverged.acceptance.host
            part.state.acceptance = dataclasses.replace(split_rows(diverged.acceptance, index),  # drawn and read once
                                                        host=([accepted[i] for i in local], prefix))
            eol = split_rows(fed.eol, index) if fed.eol is not None and fed.eol.source.shape[0] > 1 else fed.eol
            result = decoder.step(row_logits[index], row_hidden[twins], fed.draft.select_rows(index), part.state, self.draft_heads,
                                 backbone)
            _record_kept(kept, part.rows, result, eol, t)

    def _round_one(self, state: DecodingState, batch: RowBatch, cache: StaticKVCache, timer) -> None:
        """`_round` for one image: the same steps a-f, on the cache's shared length."""
        backbone, layout, sampling = self.backbone, state.layout, state.sampling
        # 5a. the decoder proposes what to verify (the last committed code first)
        with timer.section("draft"):
            draft = self.decoder.propose(state, self.draft_heads, backbone)
        # 5b. end-of-row tokens are forced, never drafted: one is fed after every fed code that ends a row
        with timer.section("eol"):
            f = insert_end_of_rows(layout, state, draft)  # (1, T')
            input_ids, position_ids, mask, eol = f.input_ids, f.position_ids, f.attention_mask, f.eol  # (1, T')
        # 5c. one target forward over the draft (CFG rows as one batch), logits over image codes
        with timer.section("forward"):
            fed = input_ids.shape[1]  # T': the real fed slots (EOLs included)
            if sampling.do_cfg:  # the unconditional rows verify the same drafts
                input_ids = input_ids.repeat(2, 1)  # (R, T')
                if draft.per_row:  # positions (B, T') and masks (B, T', T') per row
                    position_ids, mask = position_ids.repeat(2, 1), mask.repeat(2, 1, 1)
            embeds = backbone.embed_image_tokens(input_ids)  # (R, T', D)
            if eol is not None:
                embeds = eol.embeds(embeds, backbone.eol_embedding)
            if batch.fed_size is not None:  # static shapes: every round feeds the same number of slots
                embeds, position_ids, mask = self._pad_round(embeds, position_ids, mask, batch)  # (R, F, D)
            slot = cache.length
            hidden = self.target_forward(embeds, position_ids, mask, cache)[:, :fed]  # (R, T', D)
            if eol is not None:
                hidden = eol.outputs(hidden)  # (R, T, D): a row's last code sees its EOL's output
            logits = backbone.image_logits(hidden)  # (R, T, V) fp32
        # 5d-e. CFG mix; the decoder accepts codes and commits them to the state
        with timer.section("accept"):
            logits = cfg_mix(logits, sampling.guidance_scale) if sampling.do_cfg else logits  # (1, T, V)
            rows = hidden.shape[0] if self.decoder.uses_all_rows else 1
            result = self.decoder.step(logits, hidden[:rows], draft, state, self.draft_heads, backbone)
        # 5f. keep only the accepted path in the KV cache (with the EOLs that follow its row ends)
        with timer.section("kv"):
            _keep_one(cache, result, eol, slot, fed, sampling.do_cfg)

    def _hidden_rows(self, index: torch.Tensor, batch: RowBatch, rows: int) -> torch.Tensor:
        """The hidden-state rows a decoder step of the image rows ``index`` gets: their conditional rows, and their
        unconditional twins (``batch_size`` rows later) for a decoder that `uses_all_rows` under CFG (``rows`` target
        rows)."""
        if self.decoder.uses_all_rows and rows > batch.batch_size:
            return torch.cat([index, index + batch.batch_size])
        return index

    def _stats(self, batch: RowBatch, num_forward_passes: int, batch_size: int, start_time: float) -> DecodingStats:
        """What a row-group generation cost (one host read of the per-pass accepted lengths, after the last round)."""
        if batch.tokens.device.type == "cuda":
            torch.cuda.synchronize(batch.tokens.device)
        accepted = batch.accepted_lengths()  # (passes, B) 0 after a row finished
        row_passes = batch.row_passes()
        return DecodingStats(
            num_forward_passes=num_forward_passes,
            num_draft_passes=batch.num_draft_passes,
            num_tokens=batch_size * batch.layout.num_tokens,
            mean_accepted_length=accepted.sum().item() / max(sum(row_passes), 1),
            accepted_lengths=accepted.cpu(),
            acceptance_map=batch.layout.grid(batch.acceptance_map).cpu(),
            wall_time_s=time.perf_counter() - start_time,
            padded_fraction=batch.padded_slots / batch.fed_slots if batch.fed_slots else None,
            row_forward_passes=row_passes,
            decoder_stats=batch.report(),
        )

    # -- the cache, fixed shapes and the target pass ----------------------------------------------------------
    def make_cache(self, rows: int, needed: int, device: torch.device) -> StaticKVCache:
        """Step 3's KV cache. With static shapes its length is rounded up (one size serves many prompt lengths) and the
        cache is kept for the next call of the same size (`BackboneCaches.kv_cache`): its tensors keep their address,
        which CUDA graphs replay."""
        backbone = self.backbone
        if not self.static_shapes:
            return backbone.make_cache(rows, needed)
        length = static_cache_length(needed)
        cache = backbone.caches.kv_cache
        if (cache is None or cache.max_length != length or cache.storage.shape[2] != rows
                or cache.storage.dtype != backbone.dtype or cache.storage.device != torch.device(device)):
            cache = backbone.make_cache(rows, length)
            cache.fixed_shape = True
            backbone.caches.kv_cache = cache
        cache.reset()
        mark_static_cache(cache, uses_cuda_graphs(backbone.target_module, cache.storage.device))
        return cache

    def _pad_round(self, embeds, position_ids, mask, batch: RowBatch):
        """Static shapes: pad the round's fed embeddings ``(R, T', D)`` to ``batch.fed_size`` slots (`pad_fed`)."""
        fed, size = embeds.shape[1], batch.fed_size
        batch.fed_slots += size
        batch.padded_slots += size - fed
        return pad_fed(embeds, position_ids, mask, size)  # (R, F, D): padding feeds a zero vector

    def target_forward(self, embeds, position_ids, mask, cache) -> torch.Tensor:
        """The round's target pass. Under CUDA graphs each round is a new graph step and the output is copied out of
        the graph's memory (the next replay overwrites it, and decoders keep hidden states across rounds)."""
        backbone = self.backbone
        graphs = uses_cuda_graphs(backbone.target_module, embeds.device)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with varying_length_attention(embeds.device, cache.fixed_shape):
            hidden = backbone.forward(embeds, position_ids, mask, None, cache)  # (R, T', D)
        return hidden.clone() if graphs else hidden

    # -- compile --------------------------------------------------------------------------------------------
    @property
    def is_compiled(self) -> bool:
        return getattr(self.backbone.target_module, "_compiled_call_impl", None) is not None

    def compile(self, device: torch.device, mode: Optional[str] = None, dynamic: bool = False,
                fullgraph: Optional[bool] = None, backend: str = "inductor", keep_if_slower: bool = False,
                measure: bool = True, **kwargs) -> Dict[str, Any]:
        """`SpatialARPipeline.enable_compile` on ``device``: compile the target step, keep it where it measures
        faster. The rounds that run whole on the device are compiled with the same options on first use."""
        backbone = self.backbone
        module = backbone.target_module
        if mode is None and device.type == "cuda" and backend == "inductor":
            mode = "reduce-overhead"
        options = dict(backend=backend, dynamic=dynamic, fullgraph=backbone.supports_fullgraph if fullgraph is None else fullgraph,
                       **({} if mode is None else {"mode": mode}), **kwargs)
        rows, sizes = (2 if backbone.default_guidance_scale != 1.0 else 1), [1, 8]
        self.disable_compile()
        # a graph per fed size and attended length (`attend_buckets`): swapping decoders passes dynamo's default of 8
        # graphs per function, past which it would fail (fullgraph) or run eagerly without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        eager = PassCost(backbone, rows, repeats=5, warmup=1).measure(sizes) if measure else {}
        module.compile(**options)
        module._spatial_compile_mode = mode  # read by `uses_cuda_graphs`
        module._spatial_compile_options = options  # device rounds compile with the same (`_compiled_device_round`)
        compiled = PassCost(backbone, rows, repeats=5, warmup=2, compiled=True, fixed_shape=True).measure(sizes) if measure else {}
        # the passes alone: a compiled round also drops the eager ops around its pass, which this does not time
        kept_by_default = not measure or sum(compiled.values()) <= (1 + COMPILE_TOLERANCE) * sum(eager.values())
        enabled = keep_if_slower or kept_by_default
        if not enabled:
            self.disable_compile()
        backbone.caches.pass_costs.clear()  # "auto" sizes are chosen again for the forward that runs now
        return {"eager_ms": {t: 1e3 * s for t, s in eager.items()}, "compiled_ms": {t: 1e3 * s for t, s in compiled.items()},
                "enabled": enabled, "kept_by_default": kept_by_default,
                "options": {k: v for k, v in options.items() if isinstance(v, (str, bool, int, float, type(None)))}}

    def disable_compile(self) -> None:
        """Undo `compile`: the target forward runs eagerly again."""
        module = self.backbone.target_module
        module._compiled_call_impl = None  # what nn.Module.compile sets
        module._spatial_compile_mode = None
        module._spatial_compile_options = None
        module.__dict__.pop("_spatial_device_rounds", None)
        self.backbone.caches.pass_costs.clear()
        self.backbone.caches.kv_cache = None

    def _compiled_device_round(self, round_fn):
        """With the target compiled: a round that runs whole on the device (`device_chain.chain_round`,
        `head_tree_round`, `dynamic_tree_round`) compiled whole with the same options (`device_loop.compile_round`,
        ``fullgraph=True``), made once per function and compile; ``None`` when eager."""
        if not self.is_compiled:
            return None
        module = self.backbone.target_module
        rounds = module.__dict__.setdefault("_spatial_device_rounds", {})  # dropped with the compiled step
        compiled = rounds.get(round_fn.__name__)
        if compiled is None:
            options = dict(getattr(module, "_spatial_compile_options", None) or {})
            options["fullgraph"] = self.backbone.supports_fullgraph
            compiled = rounds[round_fn.__name__] = compile_round(round_fn, **options)
        return compiled

    @contextlib.contextmanager
    def profile_rounds(self, synchronize: Optional[Callable[[], None]] = None):
        """`SpatialARPipeline.profile_rounds`: a `RoundTimer` over the rounds run inside the block."""
        timer = RoundTimer(synchronize)
        self.timer = timer
        try:
            yield timer
        finally:
            self.timer = None


def check_rounds_per_sync(value) -> int:
    """``max_rounds_per_sync``: an int >= 1."""
    check_number("max_rounds_per_sync", value, 1, integer=True, meaning="rounds run between two reads of the device")
    return int(value)


def _keep_one(cache: StaticKVCache, result: StepOutput, eol, slot: int, fed: int, do_cfg: bool) -> None:
    """Step 5f for one image: keep the accepted path's slots (a tree), a prefix (a chain), or every real fed slot."""
    if result.keep_indices is not None:
        keep = result.keep_indices if eol is None else eol.keep_indices(result.keep_indices)  # (1, n)
        cache.keep(slot, keep.repeat(2, 1) if do_cfg else keep)  # (R, n)
    elif result.keep_length is not None:
        keep_length = result.keep_length if eol is None else eol.keep_length(result.keep_length)
        cache.crop(slot + keep_length)  # a prefix stays where it is: no copy
    elif cache.length > slot + fed:  # every fed slot stays, the padding does not
        cache.crop(slot + fed)


def _record_kept(kept: List[Kept], rows: List[int], result: StepOutput, eol, width: int) -> None:
    """What each of ``rows`` keeps of its fed slots after a decoder step (`StaticKVCache.keep_rows`): a prefix length,
    or the slot offsets ``(n,)`` of its accepted tree path (the end-of-row tokens after its row ends included)."""
    if result.keep_indices is not None:
        keep = result.keep_indices if eol is None else eol.keep_indices(result.keep_indices)  # (n_rows, k)
        for i, r in enumerate(rows):
            kept[r] = keep[i]
        return
    if result.keep_length is not None:
        length = result.keep_length if eol is None else eol.keep_length(result.keep_length)
    else:
        length = width  # every fed slot stays
    for r in rows:
        kept[r] = length
