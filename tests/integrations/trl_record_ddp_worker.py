"""Worker for test_trl_record.py::test_two_processes_record_a_shard_per_rank (run under torchrun)."""

import os
import sys

import torch

torch.set_num_threads(1)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import datasets  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl.experimental.sdpo import SDPOConfig, SDPOTrainer  # noqa: E402

from icsd_audit.integrations.trl import record  # noqa: E402


def main() -> None:
    out, model_dir, recorded = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = datasets.Dataset.from_dict({"prompt": ["search for a red mug", "buy blue shoes", "find a chair", "open it"] * 4})
    args = SDPOConfig(output_dir=out + "/out", per_device_train_batch_size=4, num_generations=4, max_completion_length=10,
                      max_steps=3, learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                      seed=0, dataloader_num_workers=0, disable_tqdm=True, distillation_mode="topk_logits",
                      distillation_topk=100, distillation_alpha=0.5, distillation_weight=0.5)
    tr = SDPOTrainer(model=model_dir, processing_class=tok, train_dataset=ds, args=args,
                     reward_funcs=lambda completions, **_: [float(len(c) % 3) for c in completions])
    if recorded:
        record(tr, out + "/dumps")
    tr.train()
    if tr.accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in tr.model.state_dict().items()}, out + "/params.pt")


if __name__ == "__main__":
    main()
