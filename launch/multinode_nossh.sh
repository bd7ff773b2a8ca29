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
# wait for RUN_DIR/launch.txt and run their own line from it (deepspeed --no_ssh --node_rank R ...), so the config is
# composed and the data prepared exactly once, and every node uses node 0's exact command and master port.
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
WAIT_S=${WAIT_S:-1800}  # how long nodes > 0 wait for node 0 to prepare the data
LAUNCHER=${LAUNCHER:-deepspeed_multinode}  # or torchrun

if [ "$NODE_RANK" = 0 ]; then
  rm -f "$RUN_DIR/launch.txt"  # a stale one would start the other nodes with an old command
  exec python -m dsrecipes launcher="$LAUNCHER" launcher.node_rank=0 launcher.num_nodes="$NNODES" \
    launcher.num_gpus="$GPUS_PER_NODE" launcher.master_addr="$MASTER_ADDR" launcher.master_port="$MASTER_PORT" \
    trainer.output_dir="$RUN_DIR" hydra.run.dir="$RUN_DIR" data.cache_dir="$DATA_CACHE" "$@"
fi

sleep 5  # let node 0 remove a stale launch.txt first
for _ in $(seq "$WAIT_S"); do
  [ -f "$RUN_DIR/launch.txt" ] && break
  sleep 1
done
[ -f "$RUN_DIR/launch.txt" ] || { echo "node $NODE_RANK: no $RUN_DIR/launch.txt after ${WAIT_S}s" >&2; exit 1; }
CMD=$(awk -v want="# node $NODE_RANK" 'found { print; exit } $0 == want { found = 1 }' "$RUN_DIR/launch.txt")
if [ -z "$CMD" ] && grep -q '^# launcher=torchrun' "$RUN_DIR/launch.txt"; then
  CMD=$(grep -v '^#' "$RUN_DIR/launch.txt" | sed -n 1p)  # torchrun: the same command on every node
fi
[ -n "$CMD" ] || { echo "node $NODE_RANK: no command for this node in $RUN_DIR/launch.txt" >&2; exit 1; }
echo "node $NODE_RANK: $CMD"
# The launcher, its ranks and their workers in a process group of their own: a SIGTERM/SIGINT here (a scheduler,
# Ctrl-C) reaches all of them, as on node 0 (deepspeed's no-ssh runner would otherwise die alone, leaving its ranks).
setsid bash -c "$CMD" &
CHILD=$!
trap 'kill -TERM -- "-$CHILD" 2>/dev/null || true' TERM INT
STATUS=0
wait "$CHILD" || STATUS=$?
wait "$CHILD" 2>/dev/null || true  # after a forwarded signal: until the ranks have checkpointed and exited
exit "$STATUS"
