#!/bin/bash
# The small-data study of docs/small-data.md: `aiayn train` runs on the Bible corpus that each
# change one setting of a common base, then each model's dev BLEU (beam 4), for
# bench/plot_study.py to draw.
#
#   bash bench/small_data_study.sh DATA STUDY_DIR [RUN ...]
#
# DATA holds train.en, train.es, dev.en, dev.es (the corpus of ../shared/data/bible-en-es, or
# `aiayn prepare bible-en-es` with valid.* copied to dev.*). Without RUN names it trains every run
# below, one after another (they share the CPU otherwise: run nothing else beside them). A run
# whose STUDY_DIR/NAME/dev.bleu.json exists is skipped.
#
# Every run has a step count and a linear decay to 0 at its last update (`--schedule linear`),
# so what it learns does not depend on how busy the machine is; its wall time does, so the
# study's time axis is only meaningful on an idle machine. bf16 (`--precision bf16`, a CPU with
# AMX or AVX512-BF16) learns the same per update as float32 (BENCHMARKS.md): 600 updates of 4096
# tokens, or 1200 of 2048, take 10 to 15 minutes on a 2-core Xeon with AMX, about half of what
# the recipe's 30-minute budget trains there.
set -euo pipefail
DATA=$1
STUDY=$2
shift 2
AIAYN=${AIAYN:-.venv/bin/aiayn}
COMMON="--precision bf16 --ema-decay 0.999 --schedule linear --time-budget none --valid-every 100
  --save-every 0 --log-every 25 --no-progress --threads 2"
# Every setting that differs from the recipe as it is now is given: the recipe took S5's, then
# fairseq's initialisation (the S runs drew tensor2tensor's: init=xavier), then S12's 2+2 layers
# (the S runs have the `small` preset's 3+3 unless they say otherwise).
LAYERS3="--model n_encoder_layers=3 --model n_decoder_layers=3"
# BASE: the recipe before the study.
BASE="--max-tokens 4096 --lr-scale 0.5 --model norm_first=false --model init=xavier $LAYERS3"
S5="--max-steps 1200 --warmup-steps 400 --max-tokens 2048 --lr-scale 1.0 --model norm_first=true
  --model init=xavier $LAYERS3"
# The initialisation runs (docs/small-data.md, "Initialisation"): S5's model and batches, 500
# updates of Eq. 3 in float32 without an average, as fairseq-train ran beside the recipe.
# S8: S5 with fairseq's initialisation, the recipe (then, with 3+3 layers) at 1200 updates; the
# base of the runs after it (S9-S13 each change one of its settings; S12's 2+2 layers became the
# recipe's).
S8="$S5 --model init=fairseq"
INIT="$S5 --max-steps 500 --schedule inverse_sqrt --precision fp32 --ema-decay 0"

# A greedy search: the first runs change one setting of the base, the later ones one setting of
# the best run so far (S2: 2048-token batches, as many tokens as the base in twice the updates;
# then S5: S2 with pre-norm and twice the peak rate; then S8: S5 with fairseq's initialisation).
declare -A RUNS=(
  [S1-base]="--max-steps 600 --warmup-steps 200 $BASE"
  [S2-tok2048]="--max-steps 1200 --warmup-steps 400 $BASE --max-tokens 2048"
  [S3-lr1]="--max-steps 600 --warmup-steps 200 $BASE --lr-scale 1.0"
  [S5-tok2048-prenorm-lr1]="$S5"
  [S4-bpe4k]="$S5 --vocab-size 4000"
  [S6-lr2]="$S5 --lr-scale 2.0"
  [S7-dropout03]="$S5 --model dropout=0.3"
  [S8-fairseq-init]="$S8"
  [S9-warmup200]="$S8 --warmup-steps 200"
  [S10-ls02]="$S8 --label-smoothing 0.2"
  [S11-bpe2k]="$S8 --vocab-size 2000"
  [S12-layers2]="$S8 --model n_encoder_layers=2 --model n_decoder_layers=2"
  [S13-width384]="$S8 --model d_model=384 --model d_ff=1536"
  [I0-xavier]="$INIT"
  [I1-fairseq]="$INIT --model init=fairseq"
)
ORDER=(S1-base S2-tok2048 S3-lr1 S5-tok2048-prenorm-lr1 S4-bpe4k S6-lr2 S7-dropout03 I0-xavier
  I1-fairseq S8-fairseq-init S9-warmup200 S10-ls02 S11-bpe2k S12-layers2 S13-width384)
[ $# -gt 0 ] && ORDER=("$@")

mkdir -p "$STUDY"
for name in "${ORDER[@]}"; do
  out=$STUDY/$name
  [ -s "$out/dev.bleu.json" ] && { echo "$name: done, skipped"; continue; }
  echo "$(date -u +%FT%TZ) $name: ${RUNS[$name]}" | tee -a "$STUDY/log.txt"
  # shellcheck disable=SC2086  # the settings are words
  "$AIAYN" train -c recipes/bible-en-es-cpu.yaml --src "$DATA/train.en" --tgt "$DATA/train.es" \
    --valid-src "$DATA/dev.en" --valid-tgt "$DATA/dev.es" --out-dir "$out" \
    $COMMON ${RUNS[$name]} > "$out.train.log" 2>&1
  "$AIAYN" evaluate -m "$out/model" --src "$DATA/dev.en" --ref "$DATA/dev.es" -o "$out/dev.hyp" \
    --json --no-progress --threads 2 > "$out/dev.bleu.json"
done
