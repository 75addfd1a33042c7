/*
 * distgemm over NCCL: the symmetric workspaces of distgemm's tensor-parallel GEMMs
 * (dg_all_gather_gemm, dg_gemm_reduce_scatter), set up over an NCCL communicator, for C and C++
 * programs without a framework. One process per GPU; all ranks on one node (CUDA IPC).
 *
 *   dg_nccl_workspace* ws;
 *   dg_nccl_workspace_create(comm, bytes_needed, 60.0, stream, &ws);   every rank
 *   dg_tp_desc desc = {0};  ... desc.gemm, desc.timeout_s ...
 *   dg_nccl_tp_bind(ws, &desc);                 rank, world, peer_workspaces, workspace_bytes
 *   dg_all_gather_gemm(&desc, stream);
 *   dg_nccl_workspace_destroy(ws, stream);                               every rank
 *
 * Errors return a dg_status with a message in dg_last_error(), as in distgemm.h. Library:
 * libdistgemm_nccl (CMake: find_package(distgemm) -> distgemm::nccl, beside distgemm::core).
 */
#ifndef DISTGEMM_NCCL_H_
#define DISTGEMM_NCCL_H_

#include <stddef.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "distgemm/distgemm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One rank's workspace and its mappings of every peer's (opaque). */
typedef struct dg_nccl_workspace dg_nccl_workspace;

/* Collective over comm: every rank calls it, in the same order as its other collectives on comm,
 * with the communicator's device current or not (it runs on the communicator's device and
 * restores the caller's). Each rank passes the bytes it needs (e.g. the largest
 * dg_tp_workspace_size of the calls it will make); all allocate the largest (an NCCL all-reduce
 * max), rounded up to 2 MiB, zero it, map every peer's (CUDA IPC: one process per GPU, or one
 * process driving several GPUs), and meet before returning, so that no rank writes into a peer's
 * workspace before that peer zeroed it. A rank that fails to allocate or map tells the others:
 * every rank then returns the error, naming that rank.
 *   comm: 2 to 64 ranks. stream: where the NCCL collectives run (a device of comm's).
 *   timeout_s: bound of every wait on the peers (finite, > 0). A wait past it, or an NCCL
 *     asynchronous error, aborts comm (ncclCommAbort, which frees it: do not destroy it again)
 *     and returns DG_ERROR_TIMEOUT (DG_ERROR_CUDA for an NCCL error): comm must be recreated.
 *   *out: the workspace (NULL on failure; nothing is left allocated). */
DG_API dg_status dg_nccl_workspace_create(ncclComm_t comm, size_t bytes, double timeout_s, cudaStream_t stream,
                                          dg_nccl_workspace** out);

/* Collective too: a bounded barrier on stream (after the tensor-parallel calls enqueued there,
 * so no peer still uses this rank's workspace or maps), then the peers' mappings are closed and
 * the workspace freed. ws is freed even when the barrier fails (its error is returned). Call it
 * before the communicator is destroyed. NULL: nothing to do (DG_SUCCESS, not collective). */
DG_API dg_status dg_nccl_workspace_destroy(dg_nccl_workspace* ws, cudaStream_t stream);

/* Fills desc->rank, desc->world, desc->peer_workspaces (an array owned by ws, valid until it is
 * destroyed) and desc->workspace_bytes; leaves the rest of desc alone. The tensor-parallel calls
 * then run with ws's device current. */
DG_API dg_status dg_nccl_tp_bind(const dg_nccl_workspace* ws, dg_tp_desc* desc);

/* The size of every rank's workspace (the largest request, rounded up); 0 for NULL. */
DG_API size_t dg_nccl_workspace_bytes(const dg_nccl_workspace* ws);

#ifdef __cplusplus
}
#endif

#endif /* DISTGEMM_NCCL_H_ */
