"""Is the installed verl the one icsd was written against?  The version range and every signature it relies on.

Imported by every verl module of the integration (nothing here imports verl at import
time).  The plug-in (:mod:`icsd_audit.integrations.verl.plugin`) checks the version when it
loads and, as each verl module it registers into loads, the signatures of the modules
already loaded (:func:`check_verl` with ``loaded_only``, which imports nothing);
``icsd_sync`` checks every signature when it starts.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["TESTED_VERL", "EXPECTED_SIGNATURES", "VerlCompatError", "check_version", "check_verl"]

#: [lowest tested, first untested) verl versions.
TESTED_VERL = ("0.9.1", "0.10")

#: The verl callables the integration modules call, replace or register with, and the parameter names they rely on.
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    "verl.workers.utils.losses:ppo_loss": ("config", "model_output", "data", "dp_group"),
    "verl.workers.utils.padding:no_padding_2_padding": ("tensor", "data"),
    "verl.trainer.ppo.core_algos:agg_loss": ("loss_mat", "loss_mask", "loss_agg_mode", "dp_size", "batch_num_tokens",
                                             "global_batch_size", "loss_scale_factor"),
    "verl.workers.engine_workers:ActorRolloutRefWorker.set_loss_fn": ("self", "loss_fn"),
    "verl.workers.engine_workers:TrainingWorker.set_loss_fn": ("self", "loss_fn"),
    "verl.workers.engine_workers:ActorRolloutRefWorker.compute_log_prob": ("self", "data"),
    "verl.trainer.ppo.v1.trainer_base:register_trainer": ("name",),
    "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_init_end": ("self",),
    "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync._compute_advantage": ("self", "batch", "metrics"),
    "verl.workers.utils.padding:response_from_nested": ("tensor", "response_mask"),
    "verl.workers.utils.padding:response_to_nested": ("tensor", "response_mask"),
    "verl.trainer.ppo.core_algos:register_adv_est": ("name_or_enum",),
    "verl.trainer.ppo.core_algos:get_adv_estimator_fn": ("name_or_enum",),
    "verl.trainer.ppo.ray_trainer:apply_kl_penalty": ("data", "kl_ctrl", "kl_penalty"),
    "verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch": ("batch", "rollout_corr_config"),
    "verl.protocol:DataProto.__init__": ("self", "batch"),
    "verl.utils.config:omega_conf_to_dataclass": ("config", "dataclass_type"),
    "verl.trainer.ppo.core_algos:kl_penalty": ("logprob", "ref_logprob", "kl_penalty"),
    "verl.trainer.distillation.losses:register_distillation_loss": ("loss_settings",),
    "verl.trainer.distillation.losses:get_distillation_loss_fn": ("loss_name",),
    "verl.trainer.distillation.losses:DistillationLossSettings.__init__": ("self", "_target_", "names", "use_topk",
                                                                         "use_estimator"),
    "verl.trainer.distillation.losses:distillation_loss": ("config", "distillation_config", "model_output", "data"),
    # the +icsd.record=true switch rebuilds the worker's own loss from the config (integrations/verl/record.py)
    "verl.trainer.distillation:distillation_ppo_loss": ("config", "distillation_config", "model_output", "data",
                                                       "dp_group"),
    "verl.trainer.distillation:is_distillation_enabled": ("config",),
    "verl.experimental.agent_loop.agent_loop:AgentLoopBase.__init__": ("self", "trainer_config", "server_manager",
                                                                      "tokenizer", "processor", "dataset_cls",
                                                                      "data_config"),
    "verl.experimental.agent_loop.agent_loop:AgentLoopBase.run": ("self", "sampling_params"),
    "transfer_queue:kv_batch_get": ("keys", "partition_id", "select_fields"),
    "transfer_queue:kv_batch_put": ("keys", "partition_id", "fields", "tags"),
    "transfer_queue:kv_clear": ("keys", "partition_id"),
}


class VerlCompatError(RuntimeError):
    """verl is missing, outside the tested range, or changed a signature icsd relies on."""


def resolve_dotted(path: str) -> Any:
    import importlib

    mod, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for p in v.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_version() -> str:
    """The installed verl version (from its package metadata: no import); :class:`VerlCompatError` outside the range."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        version = dist_version("verl")
    except PackageNotFoundError as e:
        raise VerlCompatError("verl is not installed: pip install 'icsd-audit[verl]'") from e
    lo, hi = TESTED_VERL
    if not (_version_tuple(lo) <= _version_tuple(version) < _version_tuple(hi)):
        raise VerlCompatError(f"verl {version} is outside the tested range [{lo}, {hi}); pip install 'icsd-audit[verl]'")
    return version


def check_verl(*, loaded_only: bool = False) -> str:
    """The installed verl version; raises :class:`VerlCompatError` naming what does not fit.

    ``loaded_only``: check only the callables whose module is already imported (imports
    nothing, so the plug-in can run it at no cost as verl's modules load).
    """
    import sys

    def loaded(module: str) -> bool:  # imported and done (not half-way through an import that imports us)
        m = sys.modules.get(module)
        return m is not None and not getattr(getattr(m, "__spec__", None), "_initializing", False)

    version = check_version()
    for path, params in EXPECTED_SIGNATURES.items():
        if loaded_only and not loaded(path.partition(":")[0]):
            continue
        try:
            obj = resolve_dotted(path)
        except (ImportError, AttributeError) as e:
            raise VerlCompatError(f"verl {version} has no {path}: {e}") from e
        fn = inspect.unwrap(getattr(obj, "__wrapped__", obj))
        got = tuple(inspect.signature(fn).parameters)
        if got[: len(params)] != params:
            raise VerlCompatError(f"verl {version} changed {path}: parameters {got}, icsd expects {params}")
    return version
