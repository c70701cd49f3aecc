"""Audio uploads for `/v1/audio/transcriptions`: a WAV file's bytes to 16 kHz mono float32 samples.

WAV (RIFF, PCM 8/16/24/32-bit integer, any rate, any channel count) is read with the standard
library's `wave` module; channels are averaged; a rate other than 16 kHz is resampled with a
Hann-windowed sinc filter (`resample`), the method of torchaudio's `functional.resample`
(`sinc_interp_hann`, 6 zero crossings, rolloff 0.99), written here because torchaudio is not a
dependency. Other containers (mp3, ogg, flac, webm) are refused with a 400 naming the field `file`
and saying how to convert.
"""

from __future__ import annotations

import io
import math
import wave

import numpy as np
import torch

from kvtui.models.whisper import MAX_AUDIO_SECONDS, SAMPLE_RATE

# How the other formats OpenAI's endpoint takes begin: told apart only to say what the file is.
_MAGIC = {b"ID3": "mp3", b"\xff\xfb": "mp3", b"\xff\xf3": "mp3", b"OggS": "ogg", b"fLaC": "flac",
          b"\x1aE\xdf\xa3": "webm"}


class AudioError(ValueError):
    """The upload is not audio this server can read; the message says why and how to fix it."""


def decode_wav(data: bytes, name: str = "file") -> np.ndarray:
    """The WAV file `data` as float32 samples in [-1, 1) at 16 kHz mono, shape [samples].

    Args:
        name: the upload's file name, for messages.

    Raises:
        AudioError: empty, not WAV (mp3, ogg, ... named), not integer PCM, no samples, or longer than
            30 s (one Whisper window; this server does not split long audio).
    """
    if not data:
        raise AudioError(f"{name} is empty: upload a WAV file")
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        kind = next((k for magic, k in _MAGIC.items() if data.startswith(magic)), None)
        what = f"an {kind} file" if kind in ("mp3", "ogg") else f"a {kind} file" if kind else "not a WAV file"
        raise AudioError(f"{name} is {what}: this server reads WAV (PCM) only; convert it, e.g. with "
                         "`ffmpeg -i IN -ar 16000 -ac 1 OUT.wav`")
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            rate, channels, width = wav.getframerate(), wav.getnchannels(), wav.getsampwidth()
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as e:
        raise AudioError(f"{name} is not a readable WAV file ({e}): upload 16-bit PCM WAV") from None
    samples = _pcm(frames, width, channels, name)
    if samples.size == 0:
        raise AudioError(f"{name} holds no audio samples")
    if samples.size / rate > MAX_AUDIO_SECONDS:
        raise AudioError(f"{name} lasts {samples.size / rate:.1f} s: at most {MAX_AUDIO_SECONDS:.0f} s per "
                         "request (one Whisper window); cut it into shorter files")
    return resample(samples, rate, SAMPLE_RATE)


def _pcm(frames: bytes, width: int, channels: int, name: str) -> np.ndarray:
    """Interleaved integer PCM frames -> float32 mono [samples] in [-1, 1)."""
    usable = len(frames) - len(frames) % (width * channels)
    raw = np.frombuffer(frames[:usable], dtype=np.uint8)
    if width == 1:  # 8-bit WAV is unsigned
        values = (raw.astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        values = np.frombuffer(raw.tobytes(), dtype=f"<i{width}").astype(np.float32) / float(2 ** (8 * width - 1))
    elif width == 3:  # 24-bit: sign-extend three little-endian bytes
        b = raw.reshape(-1, 3).astype(np.int32)
        ints = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        values = (np.where(ints >= 1 << 23, ints - (1 << 24), ints)).astype(np.float32) / float(1 << 23)
    else:
        raise AudioError(f"{name} has {8 * width}-bit samples: upload 8/16/24/32-bit integer PCM WAV")
    return values.reshape(-1, channels).mean(axis=1, dtype=np.float32)


def resample(samples: np.ndarray, orig_hz: int, new_hz: int, *, zero_crossings: int = 6,
             rolloff: float = 0.99) -> np.ndarray:
    """`samples` (float32 [n] at `orig_hz`) at `new_hz`: float32 [ceil(n * new_hz / orig_hz)].

    Band-limited interpolation with a Hann-windowed sinc low-pass at `rolloff` times the lower Nyquist
    frequency, as torchaudio.functional.resample (method "sinc_interp_hann"; after J. O. Smith,
    "Digital Audio Resampling", ccrma.stanford.edu/~jos/resample/). The rates are reduced by their gcd
    and one polyphase kernel [new, 1, width] runs as a strided conv1d.
    """
    if orig_hz == new_hz:
        return samples.astype(np.float32, copy=False)
    g = math.gcd(orig_hz, new_hz)
    orig, new = orig_hz // g, new_hz // g
    base = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx) * base
    t = t.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * (base / orig)
    x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)).double()
    n = x.numel()
    padded = torch.nn.functional.pad(x[None, None], (width, width + orig))
    out = torch.nn.functional.conv1d(padded, kernel, stride=orig)  # [1, new, frames]
    out = out.transpose(1, 2).reshape(-1)[: math.ceil(new * n / orig)]
    return out.float().numpy()
