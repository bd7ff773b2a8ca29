#!/usr/bin/env bash
# Multi-node training without ssh: start this script on every node (by hand, from a scheduler, or from
# launch/slurm_example.sbatch), each with its own NODE_RANK.
#
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 NNODES=2 GPUS_PER_NODE=8 RUN_DIR=/shared/runs/exp1 \
#       launch/multinode_nossh.sh recipe=full_ft_qwen2_5_0_5b_zero2      # on node 0
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 NNODES=2 GPUS_PER_NODE=8 RUN_DIR=/shared/runs/exp1 \
#       launch/multinode_nossh.sh                                          # on node 1 (overrides not needed)
#
# Node 0 runs the whole flow once (compose, validate, prepare data, write RUN_DIR, start its ranks). The other nodes
# run `dsrecipes node RUN_DIR --node-rank R`: it waits for node 0 to write RUN_DIR, then builds this node's command
# from the run's resolved config (the same builder node 0 used: launch.txt shows it; deepspeed's per-node launcher for
# --node_rank R, or torchrun) and supervises it, so the config is composed and the data prepared exactly once, and
# every node uses node 0's settings and master port.
# RUN_DIR and the tokenization cache (DATA_CACHE) must be on storage that every node sees at the same path.
# LAUNCHER=torchrun starts the ranks with torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT instead (every node
# runs the same torchrun command; c10d numbers the nodes). Interface pinning, e.g. for gloo on CPU nodes:
# pass '+launcher.env.GLOO_SOCKET_IFNAME=eth0' (or NCCL_SOCKET_IFNAME) to node 0. Walkthrough: launch/README.md.
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}" "${MASTER_ADDR:?set MASTER_ADDR to node 0s address}"
: "${RUN_DIR:?set RUN_DIR to a directory on shared storage}"
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}
DATA_CACHE=${DATA_CACHE:-$RUN_DIR/data_cache}
WAIT_S=${WAIT_S:-1800}  # how long nodes > 0 wait for node 0 to prepare the data and write RUN_DIR
LAUNCHER=${LAUNCHER:-deepspeed_multinode}  # or torchrun

if [ "$NODE_RANK" = 0 ]; then
  # An earlier attempt's record goes (the other nodes never take one older than this attempt's lock anyway): only in
  # a dsrecipes run directory (its marker) that no launching process holds now (flock: a node 0 started twice must
  # not take the running attempt's record, nor a mistyped RUN_DIR someone else's launch.txt).
  if [ -f "$RUN_DIR/dsrecipes_run.json" ] && [ -f "$RUN_DIR/.dsrecipes.lock" ] &&
    flock -n -s "$RUN_DIR/.dsrecipes.lock" true 2>/dev/null; then
    rm -f "$RUN_DIR/launch.txt"
  fi
  exec python -m dsrecipes launcher="$LAUNCHER" launcher.node_rank=0 launcher.num_nodes="$NNODES" \
    launcher.num_gpus="$GPUS_PER_NODE" launcher.master_addr="$MASTER_ADDR" launcher.master_port="$MASTER_PORT" \
    trainer.output_dir="$RUN_DIR" hydra.run.dir="$RUN_DIR" data.cache_dir="$DATA_CACHE" "$@"
fi

# Nodes > 0: dsrecipes waits (up to WAIT_S, saying so) for node 0 to have written this attempt's run directory, builds
# this node's command from the run's config.yaml (launch.txt is a record, never run) and supervises its ranks as on
# node 0: a SIGTERM/SIGINT here reaches them, they save within trainer.stop_grace_s, nothing is left behind.
exec python -m dsrecipes node "$RUN_DIR" --node-rank "$NODE_RANK" --wait-s "$WAIT_S"
