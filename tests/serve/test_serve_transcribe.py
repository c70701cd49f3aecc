"""`kvtui serve` with a speech model: OpenAI's /v1/audio/transcriptions through the official `openai`
client, checked against transformers' own `generate` on a separate tiny-whisper instance (greedy, the
same clip's log-mel features); its errors in OpenAI's shape naming the field; the text endpoints
refusing a speech model and the transcription endpoint a text model; decoding (WAV, FLAC, OGG, MP3
written at test time by soundfile itself) and resampling against closed-form signals; hostile headers
refused from the header alone, in well under a second and bounded memory; `kvtui run --target`
auditing a transcription server. The `whisper` tests
run Whisper tiny.en on a shipped clip and audit scenarios/transcribe.yaml through a served model."""

from __future__ import annotations

import io
import json
import math
import re
import struct
import subprocess
import sys
import wave
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile

from kvtui.engine.encoder_cache import audio_input
from kvtui.models import whisper as wh
from kvtui.serve import audio
from kvtui.serve.audio import AudioError, decode_audio, resample
from kvtui.serve.server import ServeOptions, ServeServer

ROOT = Path(__file__).resolve().parents[2]
CLIPS = sorted((ROOT / "scenarios" / "audio").glob("*.wav"))
CLIP = ROOT / "scenarios" / "audio" / "silver-rabbit-19.wav"
MAX_LEN = 24  # tiny-whisper's decoder: 2 prompt tokens + up to 22 generated
KVTUI = [sys.executable, "-m", "kvtui.cli"]


def client(server: ServeServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def whisper_server():
    options = ServeOptions(model="tiny-whisper", port=0, slots=3, max_len=MAX_LEN, detectors=("canary", "slot_taint"))
    with ServeServer(options) as server:
        yield server


@pytest.fixture(scope="module")
def oracle():
    """tiny-whisper built again (a separate instance): generate's greedy tokens and text of a clip."""
    model, tokenizer = wh.build_tiny_whisper()
    fe = wh.build_feature_extractor()

    def transcribe(clip: Path | np.ndarray) -> tuple[list[int], str]:
        """A clip's path, or its samples (float32 at 16 kHz)."""
        features = audio_input(wh.read_wav(clip) if isinstance(clip, Path) else clip, fe).features
        out = model.generate(features[None], max_new_tokens=MAX_LEN - 2, return_dict_in_generate=True)
        ids = out.sequences[0, 2:].tolist()
        return ids, tokenizer.decode(ids, skip_special_tokens=True).strip()

    return transcribe


def wav_bytes(samples: np.ndarray, rate: int, *, width: int = 2, channels: int = 1) -> bytes:
    """Float samples [n] (or [n, channels]) in [-1, 1) as an integer PCM WAV file."""
    x = samples.reshape(len(samples), -1) * np.ones((1, channels))
    if width == 1:
        raw = np.clip(np.round(x * 128 + 128), 0, 255).astype(np.uint8).tobytes()
    else:
        scale = 2 ** (8 * width - 1)
        ints = np.clip(np.round(x * scale), -scale, scale - 1).astype(np.int64)
        raw = b"".join(int(v).to_bytes(width, "little", signed=True) for v in ints.reshape(-1))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def test_transcripts_equal_generate_in_every_format(whisper_server, oracle):
    c = client(whisper_server)
    assert [m.id for m in c.models.list().data] == ["tiny-whisper"]
    for clip in CLIPS[:3]:
        ids, text = oracle(clip)
        assert len(ids) >= 2
        with open(clip, "rb") as f:
            assert c.audio.transcriptions.create(model="tiny-whisper", file=f).text == text
        with open(clip, "rb") as f:
            assert c.audio.transcriptions.create(model="tiny-whisper", file=f, response_format="text") == text + "\n"
    with open(CLIP, "rb") as f:
        verbose = c.audio.transcriptions.create(model="tiny-whisper", file=f, response_format="verbose_json",
                                                language="en", temperature=0.0)
    ids, text = oracle(CLIP)
    assert verbose.text == text and verbose.language == "english"
    assert verbose.segments[0].tokens == ids
    assert verbose.duration == pytest.approx(len(wh.read_wav(CLIP)) / 16000, abs=1e-3)


def test_concurrent_transcriptions_each_get_their_own_clip(whisper_server, oracle):
    import concurrent.futures

    c = client(whisper_server)

    def one(clip: Path) -> str:
        with open(clip, "rb") as f:
            return c.audio.transcriptions.create(model="tiny-whisper", file=f).text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, CLIPS[:6]))
    assert got == [oracle(clip)[1] for clip in CLIPS[:6]]


def test_a_stereo_upload_transcribes_as_its_mono_clip(whisper_server, oracle):
    """Two equal channels average to the clip itself (resampling is checked against sines below)."""
    samples = wh.read_wav(CLIP)
    data = wav_bytes(samples, 16000, channels=2)
    r = httpx.post(whisper_server.url + "/v1/audio/transcriptions", files={"file": ("s.wav", data)},
                   data={"model": "tiny-whisper", "response_format": "json"}, timeout=300)
    assert r.status_code == 200 and r.json()["text"] == oracle(CLIP)[1]


def wav_header(rate: int, data: bytes, *, channels: int = 1, bits: int = 16) -> bytes:
    """A PCM WAV file written field by field, so its header can say what no writer would (a rate of 0 Hz)."""
    block = channels * bits // 8
    fmt = struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * block % 2**32, block, bits)
    return b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", len(data)) + data


def encoded(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    """`samples` written by soundfile (libsndfile) as `fmt` ("FLAC", "OGG", "MP3", "AIFF", ...)."""
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


LOSSY = [("OGG", "VORBIS"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III")]


def post(server, data: dict, files=None) -> httpx.Response:
    files = files if files is not None else {"file": ("a.wav", CLIP.read_bytes(), "audio/wav")}
    return httpx.post(server.url + "/v1/audio/transcriptions", data=data, files=files, timeout=300)


@pytest.mark.parametrize("data,files,param,needle", [
    ({"model": "tiny-whisper"}, {"file": ("a.mp3", b"ID3\x03\x00" + bytes(64))}, "file", "is an mp3 file"),
    ({"model": "tiny-whisper"}, {"file": ("a.wav", b"RIFF\x10\x00\x00\x00WAVEjunk")}, "file", "not a readable WAV"),
    ({"model": "tiny-whisper"}, {"file": ("a.wav", b"")}, "file", "is empty"),
    ({"model": "tiny-whisper"}, {"file": ("a.wav", wav_header(0, bytes(4000)))}, "file", "not a readable WAV"),
    ({"model": "tiny-whisper"}, {"file": ("a.wav", wav_header(1_000_003, bytes(4000)))}, "file",
     "sample rate is 1000003 Hz"),
    ({"model": "tiny-whisper"}, {"file": ("a.webm", b"\x1aE\xdf\xa3" + bytes(64))}, "file", "is a webm file"),
    ({"model": "tiny-whisper"}, {"file": ("a.m4a", b"\0\0\0\x20ftypM4A " + bytes(64))}, "file", "is an mp4 file"),
    ({"model": "tiny-whisper"}, {"file": ("a.aiff", encoded(np.zeros(800, np.float32), 16000, "AIFF"))}, "file",
     "is AIFF audio"),
    ({"model": "tiny-whisper"}, {"file": ("a.wav", wav_bytes(np.zeros(31 * 4000, np.float32), 4000))}, "file",
     "lasts 31.0 s"),
    ({"model": "tiny-whisper", "response_format": "srt"}, None, "response_format", "needs timestamps"),
    ({"model": "tiny-whisper", "response_format": "xml"}, None, "response_format", "is not one of"),
    ({"model": "tiny-whisper", "language": "fr"}, None, "language", "English-only"),
    ({"model": "tiny-whisper", "temperature": "hot"}, None, "temperature", "not a number"),
    ({"model": "tiny-whisper", "temperature": "1.5"}, None, "temperature", "outside [0, 1]"),
    ({"model": "tiny-whisper", "timestamp_granularities[]": "word"}, None, "timestamp_granularities[]", "not supported"),
    ({}, None, "model", "model: required"),
    ({"model": "tiny-whisper"}, {"audio": ("a.wav", b"RIFF")}, "file", "file: required"),
])
def test_bad_uploads_are_400_naming_the_field(whisper_server, data, files, param, needle):
    r = post(whisper_server, data, files)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"] and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"] and "BytesIO" not in error["message"]  # one line, libsndfile's words only


def test_flac_ogg_and_mp3_uploads_transcribe_as_the_library_decodes_them(whisper_server, oracle):
    """The clip written by soundfile as FLAC (lossless: the WAV's transcript), and as OGG Vorbis, OGG Opus
    and MP3 (lossy: the transcript of the samples soundfile itself reads back)."""
    c, samples = client(whisper_server), wh.read_wav(CLIP)
    flac = encoded(samples, 16000, "FLAC")
    assert c.audio.transcriptions.create(model="tiny-whisper", file=("a.flac", flac)).text == oracle(CLIP)[1]
    for fmt, subtype in LOSSY:
        data = encoded(samples, 16000, fmt, subtype)
        theirs, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        assert rate == 16000 or subtype == "OPUS"  # Opus always decodes at 48 kHz
        if rate != 16000:
            theirs = resample(theirs, rate, 16000)
        got = c.audio.transcriptions.create(model="tiny-whisper", file=(f"a.{fmt.lower()}", data)).text
        assert got == oracle(theirs)[1], subtype


def test_decoding_other_formats_rates_and_channels():
    """FLAC equals the WAV sample for sample; the lossy formats keep the clip's length and shape
    (correlation > 0.98); 44.1 kHz stereo comes back at 16 kHz mono."""
    samples = wh.read_wav(CLIP)
    assert np.array_equal(decode_audio(encoded(samples, 16000, "FLAC")), samples)
    for fmt, subtype in LOSSY:
        got = decode_audio(encoded(samples, 16000, fmt, subtype))
        assert abs(len(got) - len(samples)) <= 16, subtype
        n = min(len(got), len(samples))
        assert np.corrcoef(got[:n], samples[:n])[0, 1] > 0.98, subtype
    stereo = resample(samples, 16000, 44100)
    got = decode_audio(encoded(np.stack([stereo, stereo], axis=1), 44100, "FLAC", "PCM_24"))
    assert abs(len(got) - len(samples)) <= 1 and np.corrcoef(got[:len(samples)], samples[:len(got)])[0, 1] > 0.999


def test_a_float_wav_holding_nan_is_refused():
    """Float WAV can carry NaN or inf, which would turn every log-mel feature into NaN."""
    samples = np.zeros(1600, np.float32)
    assert np.array_equal(decode_audio(encoded(samples, 16000, "WAV", "FLOAT")), samples)
    samples[100] = np.nan
    with pytest.raises(AudioError, match="not finite numbers"):
        decode_audio(encoded(samples, 16000, "WAV", "FLOAT"), "file a")


@pytest.mark.parametrize("make,needle", [
    (lambda: wav_header(1_000_003, bytes(4000)), "sample rate is 1000003 Hz"),
    (lambda: wav_header(3_999, bytes(4000)), "sample rate is 3999 Hz"),
    (lambda: encoded(np.zeros(4 * 48000, np.float32), 48000, "FLAC"), "lasts 4.0 s"),
    (lambda: encoded(np.zeros((8000, 8), np.float32), 8000, "FLAC"), "decodes to 0 MiB (8 channels of 8000 frames)"),
])
def test_bounds_are_checked_from_the_header_before_any_sample_is_decoded(monkeypatch, make, needle):
    """Rate, duration and decoded size are refused from soundfile.info alone (its read is never called);
    duration and size with the bounds lowered, so a small file stands for a large one."""
    data = make()
    monkeypatch.setattr(audio, "MAX_AUDIO_SECONDS", 3.0)
    monkeypatch.setattr(audio, "MAX_DECODED_BYTES", 200_000)

    def no_read(*args, **kwargs):
        raise AssertionError("decoded before the header was checked")

    monkeypatch.setattr(audio.soundfile, "read", no_read)
    with pytest.raises(AudioError, match=re.escape(needle)):
        decode_audio(data, "file a")


HOSTILE_CHILD = """
import json, resource, sys, time, tracemalloc
from kvtui.serve.audio import AudioError, decode_audio

def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

decode_audio(open(sys.argv[1], "rb").read())  # the libraries' first calls, before measuring
base, out = peak_rss(), {}
tracemalloc.start()
for path in sys.argv[2:]:
    data = open(path, "rb").read()
    tracemalloc.reset_peak()
    t = time.perf_counter()
    try:
        verdict = f"decoded {len(decode_audio(data, 'file'))} samples"
    except AudioError as e:
        verdict = str(e)
    out[path] = {"seconds": time.perf_counter() - t, "traced_peak": tracemalloc.get_traced_memory()[1],
                 "verdict": verdict}
print(json.dumps({"cases": out, "rss_growth": peak_rss() - base}))
"""


def test_hostile_headers_cost_under_a_second_and_bounded_memory(tmp_path):
    """Uploads whose headers ask for absurd work, decoded in a fresh process (so its peak RSS is the
    decoder's own): a 4 KB clip at 8001 Hz (the rates' gcd is 1: the old windowed sinc built a 16000-phase
    kernel, 21.9 s and 5 GB), a header saying 1,000,003 Hz (128 GB for that kernel), one saying 0 Hz
    (a bare 500 before), 64 channels, and a data chunk claiming 4 GB in a 4 KB file. Each takes under a
    second, Python-side allocations (tracemalloc, numpy's included) peak under 1 MiB, and the process's
    peak RSS grows by under 32 MiB."""
    hostile = {"8001hz": wav_header(8001, bytes(4000)), "1000003hz": wav_header(1_000_003, bytes(4000)),
               "0hz": wav_header(0, bytes(4000)), "64ch": wav_header(16000, bytes(4096), channels=64)}
    claims = bytearray(wav_header(16000, bytes(4000)))
    claims[40:44] = struct.pack("<I", 0xFFFFFFF0)
    hostile["4gb-claim"] = bytes(claims)
    paths = []
    for name, data in hostile.items():
        assert len(data) < 4200
        paths.append(tmp_path / f"{name}.wav")
        paths[-1].write_bytes(data)
    out = subprocess.run([sys.executable, "-c", HOSTILE_CHILD, str(CLIP)] + [str(p) for p in paths],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    cases = {Path(p).stem: c for p, c in result["cases"].items()}
    assert cases["8001hz"]["verdict"] == "decoded 4000 samples"  # 0.25 s at 8001 Hz -> 16 kHz
    assert cases["4gb-claim"]["verdict"] == "decoded 2000 samples"  # what the file holds, not what it claims
    assert "1000003 Hz" in cases["1000003hz"]["verdict"] and "not a readable WAV" in cases["0hz"]["verdict"]
    assert cases["64ch"]["verdict"] == "decoded 32 samples"
    assert {name: c["seconds"] < 1.0 and c["traced_peak"] < 2**20 for name, c in cases.items()} == \
        dict.fromkeys(cases, True), cases
    assert result["rss_growth"] < 32 * 2**20, result


def test_a_wrong_model_is_404_and_a_json_body_is_400(whisper_server):
    r = post(whisper_server, {"model": "whisper-1"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.post(whisper_server.url + "/v1/audio/transcriptions", json={"model": "tiny-whisper"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_the_text_endpoints_refuse_a_speech_model(whisper_server):
    c = client(whisper_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny-whisper", prompt="hello", max_tokens=2)
    assert e.value.body["code"] == "model_not_supported" and "/v1/audio/transcriptions" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-whisper", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["param"] == "model"
    assert httpx.get(whisper_server.url + "/health", timeout=60).status_code == 200  # still serving


def test_a_text_model_refuses_transcriptions():
    with ServeServer(ServeOptions(model="tiny-llama", port=0, slots=2, max_len=256)) as server:
        with open(CLIP, "rb") as f, pytest.raises(openai.BadRequestError) as e:
            client(server).audio.transcriptions.create(model="tiny-llama", file=f)
    assert e.value.status_code == 400 and e.value.body["param"] == "model" and "text model" in e.value.body["message"]


def test_wav_decoding_of_every_sample_width():
    t = np.arange(1600) / 16000
    x = (0.5 * np.sin(2 * math.pi * 440 * t)).astype(np.float32)
    for width, step in ((1, 1 / 128), (2, 1 / 32768), (3, 1 / 2 ** 23), (4, 1 / 2 ** 31)):
        got = decode_audio(wav_bytes(x, 16000, width=width, channels=2), "f")
        assert got.shape == x.shape and np.max(np.abs(got - x)) <= step / 2 + 1e-7, width
    with pytest.raises(AudioError, match="lasts 31.0 s"):
        decode_audio(wav_bytes(np.zeros(31 * 8000, np.float32), 8000), "f")


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampling_matches_the_sine_at_16khz(rate):
    """A 440 Hz sine sampled at `rate`, resampled to 16 kHz, equals the same sine sampled at 16 kHz
    (away from the ends, where the filter sees zeros past the signal)."""
    n = rate  # one second
    src = np.sin(2 * math.pi * 440 * np.arange(n) / rate).astype(np.float32)
    out = resample(src, rate, 16000)
    want = np.sin(2 * math.pi * 440 * np.arange(len(out)) / 16000)
    assert len(out) == 16000
    assert np.max(np.abs(out[400:-400] - want[400:-400])) < 2e-3


def write_tiny_scenario(tmp_path: Path) -> Path:
    path = tmp_path / "speech.yaml"
    path.write_text(f"name: speech\nseed: 0\nmax_requests: 6\nmodel: tiny-whisper\nengine: {{slots: 3, max_len: {MAX_LEN}}}\n"
                    f"arrivals: {{process: poisson, rate_per_s: 20}}\nprompts: {{kind: audio, path: {CLIPS[0].parent}}}\n"
                    "output_tokens: 8\nsampling: greedy\n")
    return path


def test_cli_run_target_audits_a_transcription_server(whisper_server, oracle, tmp_path):
    from kvtui.record import read_recording

    rec = tmp_path / "run.jsonl"
    out = subprocess.run(KVTUI + ["run", str(write_tiny_scenario(tmp_path)), "--target", whisper_server.url,
                                  "--headless", "--record", str(rec)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    header, events, summary, truncated = read_recording(rec)
    assert header.engine["api"] == "transcription" and not truncated
    assert summary.finish_reasons == {"stop": 6} and summary.reference_checked == 6
    finishes = {e.request_id: e for e in events if type(e).__name__ == "Finish"}
    planned = sorted(CLIPS)
    for i, rid in enumerate(sorted(finishes)):
        assert finishes[rid].output_text == oracle(planned[i % len(planned)])[1]
    assert re.search(r"contamination findings +0", out.stdout)
    # the endpoint returns text: the summary counts words, and says so, never "tokens"
    words = sum(len(f.output_text.split()) for f in finishes.values())
    assert re.search(rf"generated words +{words} \(transcripts split at spaces", out.stdout), out.stdout
    assert "generated tokens" not in out.stdout and "output words/s" in out.stdout


@pytest.mark.whisper
def test_whisper_tiny_en_transcribes_a_shipped_clip_and_passes_an_audit(whisper_en, tmp_path):
    options = ServeOptions(model="whisper-tiny.en", port=0, slots=3, max_len=448, detectors=("canary", "slot_taint"))
    with ServeServer(options) as server:
        with open(CLIP, "rb") as f:
            text = client(server).audio.transcriptions.create(model="whisper-tiny.en", file=f).text
        assert "silver rabbit 19" in text.lower()
        out = subprocess.run(KVTUI + ["run", str(ROOT / "scenarios" / "transcribe.yaml"), "--target", server.url,
                                      "--headless"], capture_output=True, text=True, timeout=900)
        text = httpx.get(server.url + "/metrics", timeout=60).text
    assert not re.search(r'kvtui:contamination_events_total\{[^}]*detector="canary"', text)  # none inside either
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"own passphrase echoed +12/12", out.stdout)
    assert re.search(r"reference checks +12 checked", out.stdout)
    assert re.search(r"contamination findings +0", out.stdout)


@pytest.mark.whisper
def test_whisper_tiny_en_hears_the_clip_in_flac_ogg_and_mp3_at_other_rates(whisper_en):
    """The shipped clip re-encoded by soundfile: FLAC at 44.1 kHz stereo, OGG Vorbis at 16 kHz, MP3 at
    22.05 kHz; Whisper tiny.en hears its passphrase in each."""
    samples = wh.read_wav(CLIP)
    at_44k, at_22k = resample(samples, 16000, 44100), resample(samples, 16000, 22050)
    uploads = {"a.flac": encoded(np.stack([at_44k, at_44k], axis=1), 44100, "FLAC", "PCM_16"),
               "a.ogg": encoded(samples, 16000, "OGG", "VORBIS"), "a.mp3": encoded(at_22k, 22050, "MP3")}
    options = ServeOptions(model="whisper-tiny.en", port=0, slots=3, max_len=448, detectors=("canary",))
    with ServeServer(options) as server:
        c = client(server)
        heard = {name: c.audio.transcriptions.create(model="whisper-tiny.en", file=(name, data)).text
                 for name, data in uploads.items()}
    assert all("silver rabbit 19" in text.lower() for text in heard.values()), heard


@pytest.mark.parametrize("name", ["tiny-whisper", pytest.param("whisper-tiny.en", marks=pytest.mark.whisper)])
def test_serve_defaults_max_len_to_the_decoders_positions(name, request):
    """`kvtui serve --model <whisper>` without --max-len takes the decoder's learned positions (serve's
    default 512 is more than a Whisper decoder has and would be refused)."""
    from kvtui.cli.serve import speech_max_len
    from kvtui.models import load_model

    if name == "whisper-tiny.en":
        request.getfixturevalue("whisper_en")
    assert speech_max_len(name) == load_model(name, progress=False).model.config.max_target_positions


@pytest.mark.whisper
def test_an_audit_of_a_faulty_transcription_server_names_victim_and_source(whisper_en, tmp_path):
    """stale_cross_kv in the served engine: a request in a reused slot reads its previous owner's clip;
    the client-side canary sees that clip's passphrase in the transcript and names both requests, and
    the server's own canary and slot_taint count it."""
    path = tmp_path / "stale.yaml"
    path.write_text(f"name: stale\nseed: 0\nmax_requests: 6\nmodel: whisper-tiny.en\nengine: {{max_len: 448}}\n"
                    f"arrivals: {{process: constant, rate_per_s: 8.0}}\n"
                    f"prompts: {{kind: spoken_passphrase, clips: {CLIPS[0].parent}}}\n"
                    "output_tokens: {dist: fixed, value: 24}\nsampling: greedy\n")
    options = ServeOptions(model="whisper-tiny.en", port=0, slots=2, max_len=448, faults=("stale_cross_kv",),
                           detectors=("canary", "slot_taint"))
    with ServeServer(options) as server:
        out = subprocess.run(KVTUI + ["run", str(path), "--target", server.url, "--headless"],
                             capture_output=True, text=True, timeout=900)
        text = httpx.get(server.url + "/metrics", timeout=60).text
    # inside the server too: its canary (the uploads' names are their passphrases) and slot_taint
    found = {m.group(1): float(m.group(2)) for m in
             re.finditer(r'kvtui:contamination_events_total\{[^}]*detector="(\w+)"[^}]*\} ([\d.]+)', text)}
    assert found.get("canary", 0) >= 1 and found.get("slot_taint", 0) >= 1, text
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"r\d{3} <- r\d{3}", out.stdout + out.stderr), out.stdout


def test_a_prompt_conditions_the_decoder_as_transformers_forward_does(whisper_server):
    """`prompt` goes before the decoder prompt (tiny-whisper has no <|startofprev|>: the text's ids alone);
    the oracle is a greedy loop over a separate instance's full forward."""
    import torch

    from kvtui.scenario.plan import decoder_prompt

    model, tokenizer = wh.build_tiny_whisper()
    ids = decoder_prompt(tokenizer, "hi there")
    assert ids[-2:] == [257, 260] and len(ids) == 2 + len(" hi there")
    features = audio_input(wh.read_wav(CLIP), wh.build_feature_extractor()).features[None]
    out: list[int] = []
    with torch.inference_mode():
        while len(ids) + len(out) < MAX_LEN and (not out or out[-1] != 256):
            logits = model(input_features=features, decoder_input_ids=torch.tensor([ids + out])).logits
            out.append(int(logits[0, -1].argmax()))
    with open(CLIP, "rb") as f:
        verbose = client(whisper_server).audio.transcriptions.create(model="tiny-whisper", file=f, prompt="hi there",
                                                                     response_format="verbose_json")
    assert verbose.segments[0].tokens == out
    r = post(whisper_server, {"model": "tiny-whisper", "prompt": "x" * 40})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
