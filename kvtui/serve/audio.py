"""Audio uploads for `/v1/audio/transcriptions`: a file's bytes to 16 kHz mono float32 samples.

Decoding is libsndfile's, through `soundfile` (its wheel bundles the library): WAV (integer or float
PCM), FLAC, OGG (Vorbis, Opus) and MP3, the formats of OpenAI's endpoint that libsndfile reads.
Channels are averaged; another rate is resampled to 16 kHz by `soxr` (libsoxr, "HQ"), whose cost
grows with the samples in and out, not with the ratio of the two rates (an upload at 8001 Hz costs
what one at 8000 Hz does).

Everything the decoder will allocate is checked from the file's header (`soundfile.info`) before a
sample is decoded: the format, the sample rate (MIN_RATE_HZ to MAX_RATE_HZ), the duration (at most
MAX_AUDIO_SECONDS, one Whisper window) and the decoded size (frames x channels x 4 bytes, at most
MAX_DECODED_BYTES); the read asks for no more than the checked frames, so nothing past them is
decoded whatever the body holds. Anything else (mp4, webm, a file cut short,
a header libsndfile refuses) is an AudioError with one line saying what the file is and what to
upload instead; the server answers it with a 400 naming the field `file`.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile
import soxr

from kvtui.models.whisper import MAX_AUDIO_SECONDS, SAMPLE_RATE

FORMATS = {"WAV": "WAV", "WAVEX": "WAV", "FLAC": "FLAC", "OGG": "OGG", "MP3": "MP3"}  # libsndfile's names
READS = "WAV, FLAC, OGG (Vorbis, Opus) and MP3"
UPLOAD = "upload WAV, FLAC, OGG (Vorbis, Opus) or MP3 audio"
MIN_RATE_HZ, MAX_RATE_HZ = 4_000, 192_000
MAX_DECODED_BYTES = 64 * 2**20  # float32 frames x channels: 30 s of 192 kHz stereo fits
CONVERT = "convert it, e.g. with `ffmpeg -i IN -ar 16000 -ac 1 OUT.wav`"
# How files begin, to say what an unreadable upload is.
_MAGIC = ((b"RIFF", "WAV"), (b"ID3", "mp3"), (b"\xff\xfb", "mp3"), (b"\xff\xf3", "mp3"), (b"\xff\xf2", "mp3"),
          (b"OggS", "ogg"), (b"fLaC", "flac"), (b"\x1aE\xdf\xa3", "webm"))


class AudioError(ValueError):
    """The upload is not audio this server can read; the message says why and how to fix it."""


def decode_audio(data: bytes, name: str = "file") -> np.ndarray:
    """The audio file `data` as float32 samples at 16 kHz mono, shape [samples].

    Args:
        name: how messages call the upload (e.g. "file a.wav").

    Raises:
        AudioError: empty; not a format listed in READS; a header libsndfile refuses; a sample rate
            outside MIN_RATE_HZ..MAX_RATE_HZ; no samples; longer than MAX_AUDIO_SECONDS; more than
            MAX_DECODED_BYTES decoded; a body that fails to decode; a sample that is NaN or inf.
    """
    if not data:
        raise AudioError(f"{name} is empty: {UPLOAD}")
    try:
        info = soundfile.info(io.BytesIO(data))
    except (soundfile.SoundFileError, RuntimeError, ValueError, TypeError, EOFError) as e:
        raise AudioError(_unreadable(data, name, e)) from None
    frames = _check_header(info, name)
    try:  # at most the checked frames: soundfile never reads past the count it is given
        samples, _ = soundfile.read(io.BytesIO(data), frames=frames, dtype="float32", always_2d=True)
    except (soundfile.SoundFileError, RuntimeError, ValueError, TypeError, EOFError, MemoryError) as e:
        raise AudioError(f"{name} ({info.format} {info.subtype}) fails to decode ({_reason(e)}): {CONVERT}") from None
    if len(samples) == 0:
        raise AudioError(f"{name} holds no audio samples")
    if not np.isfinite(samples).all():  # float WAV may hold NaN or inf, which would make every feature NaN
        raise AudioError(f"{name} holds samples that are not finite numbers (NaN or inf): {UPLOAD}")
    return resample(samples.mean(axis=1, dtype=np.float32), info.samplerate, SAMPLE_RATE)


def _check_header(info, name: str) -> int:
    """The frames the header says the file holds, once its format, rate, duration and decoded size are
    within bounds; AudioError naming the first that is not."""
    kind = FORMATS.get(info.format)
    if kind is None:
        raise AudioError(f"{name} is {info.format} audio ({info.format_info}): this server reads {READS}; {CONVERT}")
    rate = info.samplerate
    if not MIN_RATE_HZ <= rate <= MAX_RATE_HZ:
        raise AudioError(f"{name} says its sample rate is {rate} Hz: this server takes {MIN_RATE_HZ} to "
                         f"{MAX_RATE_HZ} Hz; {CONVERT}")
    frames, channels = int(info.frames), int(info.channels)
    if frames <= 0:
        raise AudioError(f"{name} holds no audio samples")
    if frames > MAX_AUDIO_SECONDS * rate:
        raise AudioError(f"{name} lasts {frames / rate:.1f} s: at most {MAX_AUDIO_SECONDS:.0f} s per request (one "
                         "Whisper window); cut it into shorter files")
    decoded = frames * channels * 4
    if decoded > MAX_DECODED_BYTES:
        raise AudioError(f"{name} decodes to {decoded / 2**20:.0f} MiB ({channels} channels of {frames} frames): at "
                         f"most {MAX_DECODED_BYTES // 2**20} MiB; upload mono or stereo")
    return frames


def _reason(e: BaseException) -> str:
    """libsndfile's own words for an error (soundfile adds the BytesIO object's repr around them)."""
    text = getattr(e, "error_string", None) or str(e) or type(e).__name__
    return text.strip().rstrip(".")


def _unreadable(data: bytes, name: str, e: BaseException) -> str:
    """One line on an upload libsndfile cannot open: what it looks like, why, what to upload."""
    kind = next((k for magic, k in _MAGIC if data.startswith(magic)), None)
    if data[4:8] == b"ftyp":
        kind = "mp4"
    if kind == "WAV":
        return f"{name} is not a readable WAV file ({_reason(e)}): {UPLOAD}"
    article = "an" if kind in ("mp3", "mp4", "ogg") else "a"
    if kind in ("webm", "mp4"):
        return f"{name} is {article} {kind} file: this server reads {READS}; {CONVERT}"
    if kind is not None:
        return f"{name} is {article} {kind} file that cannot be decoded ({_reason(e)}); {CONVERT}"
    return f"{name} is not audio this server can read ({_reason(e)}): {UPLOAD}"


def resample(samples: np.ndarray, orig_hz: int, new_hz: int) -> np.ndarray:
    """`samples` (float32 [n] at `orig_hz`) at `new_hz` (float32, about n x new_hz / orig_hz samples), by
    libsoxr at its "HQ" quality: cost in proportion to the samples in and out, whatever the rates."""
    if orig_hz == new_hz:
        return np.ascontiguousarray(samples, dtype=np.float32)
    return soxr.resample(np.ascontiguousarray(samples, dtype=np.float32), orig_hz, new_hz, quality="HQ")
