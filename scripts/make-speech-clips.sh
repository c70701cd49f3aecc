#!/usr/bin/env bash
# Synthesize the spoken passphrase clips in scenarios/audio/ (committed, so running them needs
# nothing outside PyPI; this script only remakes them).
#
# Needs espeak-ng and sox (Debian: apt-get install -y espeak-ng sox). espeak-ng's output is
# byte-identical run to run, and sox resamples without dither (-D), so the clips are too.
# Each clip says "The passphrase is WORD WORD NN." slowly (-s 110 to 145 words per minute) with
# 80 ms gaps between words (-g 8, units of 10 ms): at espeak-ng's default 175 wpm and no gaps,
# Whisper tiny.en mishears a word in about one clip in four. Output: 16 kHz mono 16-bit WAV.
#
#   scripts/make-speech-clips.sh [OUT_DIR]     (default: scenarios/audio)
set -euo pipefail
out="${1:-$(dirname "$0")/../scenarios/audio}"
mkdir -p "$out"
for tool in espeak-ng sox; do
  command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install -y espeak-ng sox" >&2; exit 2; }
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# name | words | number | speed (words per minute)
while IFS='|' read -r name words number speed; do
  espeak-ng -v en -s "$speed" -g 8 -w "$tmp/$name.wav" "The passphrase is $words $number."
  sox -D "$tmp/$name.wav" -r 16000 -c 1 -b 16 "$out/$name.wav"
  echo "$out/$name.wav: \"The passphrase is $words $number.\" at $speed wpm"
done <<'LIST'
silver-rabbit-19|silver rabbit|19|110
velvet-anchor-42|velvet anchor|42|115
copper-falcon-67|copper falcon|67|120
amber-lantern-23|amber lantern|23|125
crimson-harbor-85|crimson harbor|85|130
golden-meadow-31|golden meadow|31|135
purple-tiger-58|purple tiger|58|140
cobalt-river-74|cobalt river|74|145
LIST
