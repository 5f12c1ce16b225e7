#!/usr/bin/env bash
# GPU checks for icsd, from the repository root on a machine with an NVIDIA GPU and torch, transformers and peft
# installed (no install of icsd needed): the CUDA-only tests, and tiny-random training on CUDA (bf16-mixed and
# float32, full fine-tuning and LoRA) whose dumps `icsd audit verify` recomputes. Wheels for packages that machine
# lacks (gguf, bm25s: the [train] extra) may wait in .whl/ and are installed to /tmp/site first.
# Usage: bash benchmarks/gpu_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# the package maps data_schemas/ and cli/ into icsd_audit (pyproject package-dir); a link does the same in place
links=()
for sub in data_schemas cli; do
  [ -e "icsd_audit/$sub" ] || { ln -s "../$sub" "icsd_audit/$sub" && links+=("icsd_audit/$sub"); }
done
trap 'for l in "${links[@]}"; do [ -L "$l" ] && rm "$l"; done' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'peft', peft.__version__)"
echo "== CUDA tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/grads/test_sketch.py tests/train/test_models.py tests/train/test_lora.py -k "not cli_lora and not eval_with_adapter and not embedded" 2>&1 | tail -15
for prec in auto float32; do
  for lora in 0 4; do
    d=/tmp/g-$prec-$lora
    echo "== train tiny-random on cuda, precision=$prec, lora=$lora"
    /usr/bin/time -f "wall %e s, peak RSS %M KiB" timeout 200 python3 -c "import sys; from cli.main import main; sys.argv[0]='icsd'; main()" train --model tiny-random --steps 2 --lora $lora --set device=cuda --set precision=$prec --set sketch_k=16 --out $d --plain 2>&1 | grep -E "^\[|done:|error|Error|wall" | grep -v "running for" | tail -12
    python3 -c "import json; [print({k: v for k, v in json.loads(l).items() if k in ('step', 'rollout/invalid_rate', 'actor/kl', 'time/step')}) for l in open('$d/metrics.jsonl')]"
    python3 -c "import sys; from cli.main import main; sys.argv[0]='icsd'; main()" audit verify $d/dumps 2>&1 | tail -2
    CUDA_VISIBLE_DEVICES= python3 -c "import sys; from cli.main import main; sys.argv[0]='icsd'; main()" audit gradcos $d/dumps 2>&1 | tail -4
  done
done
