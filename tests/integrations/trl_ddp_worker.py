"""Worker for test_trl.py::test_two_process_data_parallel_gathers_before_allocating (run under torchrun)."""

import sys

import torch

torch.set_num_threads(1)

import datasets  # noqa: E402

from trl import GRPOConfig  # noqa: E402

from icsd_audit.integrations.trl.trainer import ICSDConfig, ICSDGRPOTrainer, skill_teacher_prompt  # noqa: E402
from icsd_audit.train.models.loading import tiny_random_causal_lm  # noqa: E402
from icsd_audit.train.teacher.skills import load_skillbank  # noqa: E402


class Recording(ICSDGRPOTrainer):
    """Saves each process's slice of c and the allocation it computed."""

    def _generate_and_score_completions(self, inputs):
        o = super()._generate_and_score_completions(inputs)
        torch.save({"c_local": o["icsd_c"], "c_global": self.icsd_last.c, "n": self.accelerator.num_processes},
                   f"{sys.argv[1]}/rank{self.accelerator.process_index}-batch{self.icsd_batch_id()}.pt")
        return o


def main() -> None:
    out = sys.argv[1]
    model, tok = tiny_random_causal_lm(seed=0)
    ds = datasets.Dataset.from_dict({"prompt": ["search for a red mug", "buy blue shoes", "find a chair", "open it"] * 4})
    args = GRPOConfig(output_dir=out + "/out", per_device_train_batch_size=4, num_generations=4, max_completion_length=10,
                      max_steps=2, use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=0,
                      dataloader_num_workers=0)
    tr = Recording(model=model, processing_class=tok, reward_funcs=lambda completions, **_: [float(len(c) % 5) for c in completions],
                   args=args, train_dataset=ds, icsd=ICSDConfig(min_group=2, dump_dir=out + "/dumps"),
                   teacher_prompt=skill_teacher_prompt(load_skillbank("webshop")))
    tr.train()


if __name__ == "__main__":
    main()
