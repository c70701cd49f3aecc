"""The batching engine: KV slot pool (or paged KV blocks with prefix caching), scheduler, padded/packed
layouts, pooled attention, runner.

Only runner.py (and encoder.py, its encoder-decoder twin for Whisper; image_side.py through the image
encoder) calls a model; everything else is plain data or small tensor builders. A Whisper request carries its audio: `Engine.submit(id,
RequestInput(decoder_prompt_ids, audio=audio_input(samples_16k, feature_extractor)), sampling)`; prompt
embeddings and images travel the same way (kvtui/engine/inputs.py).
"""

from kvtui.engine.attention import StepInterrupted
from kvtui.engine.encoder_cache import AudioInput, audio_input
from kvtui.engine.engine import Engine, StepCostModel
from kvtui.engine.inputs import ImagePart, PromptEmbeds, RequestInput
from kvtui.engine.report import FinishedRequestReport, RunningEntry, StepEvent
from kvtui.engine.request import FinishCode, FinishReason, RequestState, RequestStatus, SamplingParams

__all__ = [
    "Engine", "StepCostModel", "StepInterrupted", "StepEvent", "RunningEntry", "FinishedRequestReport",
    "RequestState", "RequestStatus", "FinishReason", "FinishCode", "SamplingParams", "AudioInput", "audio_input",
    "RequestInput", "PromptEmbeds", "ImagePart",
]
