#!/usr/bin/env bash
# Decoding a real test set with a trained `base` model (issue 29's second model), where a GPU is.
#
# No trained `base` (6+6 layers, d_model 512) fits a session on the 2-core CPU machines: 25
# minutes there gave 458 updates and BLEU ~2 (BENCHMARKS.md). So this script trains one on a GPU
# in a few minutes (the Bible recipe's settings at `base` size, bf16 there), then times decoding
# the way bench/bench_translate.py does on the 2-core machines: on two of this machine's CPU
# cores (taskset), the GPU hidden from every system, aiayn and CTranslate2 side by side.
#
#   bench/base_model.sh DATA OUT [MINUTES] [LINES] [ROUNDS]
#
# DATA holds train.{en,es} and dev.{en,es} (and may hold tokenizer.model, the SentencePiece model
# of the CPU runs, so that every model shares one vocabulary); OUT receives the training log and
# one markdown table and JSON file per round (base-round-N.md/json), each written as soon as its
# round ends. MINUTES of training (default 3), the first LINES dev sentences (default 400),
# ROUNDS rounds (default 2).
set -euo pipefail
DATA=$1 OUT=$2 MINUTES=${3:-3} LINES=${4:-400} ROUNDS=${5:-2}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
RUN=$(mktemp -d)/base
tokenizer=()
[ -f "$DATA/tokenizer.model" ] && tokenizer=(--tokenizer "$DATA/tokenizer.model")

# Pre-norm at the paper's base size; dropout 0.3 for a corpus of ~26k pairs seen ~15 times;
# batches of 8k tokens a side (the GPU's throughput is bound by the host at this size).
PYTHONUNBUFFERED=1 $PYTHON -m aiayn train -c recipes/bible-en-es-cpu.yaml \
    --src "$DATA/train.en" --tgt "$DATA/train.es" \
    --valid-src "$DATA/dev.en" --valid-tgt "$DATA/dev.es" ${tokenizer[@]+"${tokenizer[@]}"} \
    --preset base --model n_encoder_layers=6 --model n_decoder_layers=6 --model dropout=0.3 \
    --max-tokens 8192 --warmup-steps 1000 --time-budget "${MINUTES}m" \
    --valid-every 100000 --save-every 100000 --out-dir "$RUN" 2>&1 | tee "$OUT/train.log"

head -n "$LINES" "$DATA/dev.en" > "$RUN/test.en"
head -n "$LINES" "$DATA/dev.es" > "$RUN/test.es"
pin=()
command -v taskset > /dev/null && pin=(taskset -c 0,1)
for round in $(seq 1 "$ROUNDS"); do
    CUDA_VISIBLE_DEVICES= ${pin[@]+"${pin[@]}"} $PYTHON bench/bench_translate.py -m "$RUN/model" \
        --src "$RUN/test.en" --ref "$RUN/test.es" --beam 4 --threads 2 --rounds 1 \
        --variant int8=--int8 --skip='-m MODEL --backend' \
        --markdown "$OUT/base-round-$round.md" --json "$OUT/base-round-$round.json"
done
