"""The pipeline (pipeline_utils), its generation loop (generation) and one file per backbone family (``pipeline_<family>.py``).

Every ``pipeline_*.py`` module here is imported with the package and exports the names in its ``__all__`` (where it
has none: the pipeline and backbone classes it defines). A new family is its file: its pipeline class, with its own
``dummy_components``, joins `family_pipelines` by being defined.

`SpatialARPipeline.from_pretrained` checks a folder with `folder_checks.check_pipeline_folder`, bound on the class here
(that module looks the pipeline classes up, so the pipeline's module does not import it)."""

from ..utils import import_modules
from .backbone import PromptEmbeddings, SpatialBackbone
from .folder_checks import check_pipeline_folder
from .generation import GenerationLoop, LoopHooks
from .pass_cost import CPU_DRAFT_SIZES, GPU_DRAFT_SIZES, PassCost, RoundCost
from .pipeline_output import DecodingStats, SpatialPipelineOutput
from .pipeline_utils import SpatialARPipeline, family_pipelines

SpatialARPipeline._folder_check = staticmethod(check_pipeline_folder)

__all__ = ["CPU_DRAFT_SIZES", "DecodingStats", "GPU_DRAFT_SIZES", "GenerationLoop", "LoopHooks", "PassCost", "PromptEmbeddings", "RoundCost", "SpatialBackbone",
           "SpatialPipelineOutput",
           *import_modules(globals(), "pipeline_", lambda c: issubclass(c, (SpatialARPipeline, SpatialBackbone)))]
