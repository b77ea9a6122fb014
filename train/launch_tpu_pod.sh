#!/usr/bin/env bash
# Runs the same training command on every host of a Cloud TPU pod slice.
#   bash train/launch_tpu_pod.sh <tpu-name> <zone> <recipe.toml> [extra trainer flags]
# Each host runs `python -m eagle_jax.train --recipe ... --distributed`; jax.distributed.initialize()
# discovers the slice from the TPU metadata, and the trainer's mesh spans every chip of every host.
# Rerunning the same command resumes from the newest checkpoint in the recipe's out_dir (use a
# shared filesystem or GCS-fuse mount for out_dir).
set -euo pipefail
tpu=${1:?tpu name}; zone=${2:?zone}; recipe=${3:?recipe toml}; shift 3
repo_dir=${REPO_DIR:-\$HOME/eagle-jax}
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  cd $repo_dir && pip install -q -e . 'jax[tpu]' && \
  python -m eagle_jax.train --recipe $recipe --distributed $*"
