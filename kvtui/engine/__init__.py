"""The batching engine: KV slot pool (or paged KV blocks with prefix caching), scheduler, padded/packed
layouts, pooled attention, runner.

Only runner.py calls the model; everything else is plain data or small tensor builders.
"""

from kvtui.engine.attention import StepInterrupted
from kvtui.engine.engine import Engine, StepCostModel
from kvtui.engine.report import FinishedRequestReport, RunningEntry, StepEvent
from kvtui.engine.request import FinishCode, FinishReason, RequestState, RequestStatus, SamplingParams

__all__ = [
    "Engine", "StepCostModel", "StepInterrupted", "StepEvent", "RunningEntry", "FinishedRequestReport",
    "RequestState", "RequestStatus", "FinishReason", "FinishCode", "SamplingParams",
]
