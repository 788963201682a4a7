"""What several test files share, in one place (no test file imports another): the pipeline tester mixin, the
decoder and family tables, reference computations, fixtures and the script runner."""

from .examples import benchmark_parse_decoder, example_problems
from .fixtures import (
    OracleHeads,
    chameleon_code,
    chameleon_reference_greedy,
    code_ids_from_names,
    expected_passes,
    lay_out_hub_cache,
    record_device_loops,
    tiny_pipeline_with_every_heads,
    transformers_sdpa,
    write_transformers_repo,
)
from .pipeline_tester import PipelineTesterMixin, gen
from .reference import (
    DISTRIBUTION_SAMPLES,
    chi_square_pvalue,
    exact_joint_distribution,
    full_sequence_probs,
    grid_index,
    naive_greedy,
)
from .scripts import SCRIPTS, load_script, run_script
from .tables import DECODER_CASES, EXACT_CASES, FAMILY_CASES, make

__all__ = [
    "DECODER_CASES",
    "DISTRIBUTION_SAMPLES",
    "EXACT_CASES",
    "FAMILY_CASES",
    "SCRIPTS",
    "OracleHeads",
    "PipelineTesterMixin",
    "benchmark_parse_decoder",
    "chameleon_code",
    "chameleon_reference_greedy",
    "chi_square_pvalue",
    "code_ids_from_names",
    "exact_joint_distribution",
    "example_problems",
    "expected_passes",
    "full_sequence_probs",
    "gen",
    "grid_index",
    "lay_out_hub_cache",
    "record_device_loops",
    "load_script",
    "make",
    "naive_greedy",
    "run_script",
    "tiny_pipeline_with_every_heads",
    "transformers_sdpa",
    "write_transformers_repo",
]
