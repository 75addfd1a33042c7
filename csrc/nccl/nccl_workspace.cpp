// distgemm_nccl: the tensor-parallel GEMMs' symmetric workspaces over an NCCL communicator
// (distgemm/nccl.h). Each rank cudaMallocs its workspace, the 64-byte CUDA IPC handles travel by
// ncclAllGather, and every peer's is opened with cudaIpcOpenMemHandle (runtime API only: nothing
// here needs libcuda at link time; no NVLink multicast object, no NCCL window registration).
// Every wait on the other ranks is bounded: an NCCL op is enqueued on the caller's stream and
// the host polls cudaStreamQuery and ncclCommGetAsyncError until it is done or timeout_s passes,
// which aborts the communicator.
#include "distgemm/nccl.h"

#include <unistd.h>

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "tp/tp_layout.h"

namespace {

constexpr int kMinWorld = 2;
using distgemm::tp::kMaxWorld;                    // the largest group the TP core takes
constexpr size_t kGranularity = size_t{2} << 20;  // whole 2 MiB pages: 256-byte aligned, IPC-able
// The size a rank that failed before the exchange contributes to its max: no request rounds to it.
constexpr uint64_t kFailedSize = UINT64_MAX;

// What each rank tells the others about its workspace (one all-gather of world records).
struct Record {
  cudaIpcMemHandle_t handle;  // 64 bytes
  uint64_t process;           // this process's token: peers in the same process skip IPC
  uint64_t address;           // the workspace's address (used by peers in the same process)
  int32_t device;
  int32_t ok;  // allocation, zeroing and export succeeded
  char pad[40];
};
static_assert(sizeof(Record) == 128, "Record is a 128-byte slot");

// A per-process random token (a pid alone can repeat across PID namespaces on one host).
uint64_t process_token() {
  static const uint64_t token = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  }();
  return token;
}

std::string nccl_message(ncclComm_t comm, ncclResult_t r) {
  std::string m = ncclGetErrorString(r);
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  if (last && *last) m += distgemm::cat(" (", last, ")");
  return m;
}

// Makes the communicator's device current and restores the caller's.
class DeviceGuard {
 public:
  dg_status enter(int device) {
    DG_CUDA_RETURN(cudaGetDevice(&previous_));
    if (previous_ != device) {
      DG_CUDA_RETURN(cudaSetDevice(device));
      switched_ = true;
    }
    return DG_SUCCESS;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// The bounded collectives of one create or destroy on (comm, stream).
class Collectives {
 public:
  Collectives(ncclComm_t comm, cudaStream_t stream, double timeout_s, const char* caller)
      : comm_(comm), stream_(stream), timeout_s_(timeout_s), caller_(caller) {}
  ~Collectives() {
    if (before_) cudaEventDestroy(before_);
    if (after_) cudaEventDestroy(after_);
  }
  Collectives(const Collectives&) = delete;
  Collectives& operator=(const Collectives&) = delete;

  bool aborted() const { return aborted_; }

  // Checks what an NCCL call returned; a non-blocking communicator's ncclInProgress is waited
  // out (bounded) before the op is on the stream.
  dg_status enqueued(ncclResult_t r, const char* what) {
    const auto start = std::chrono::steady_clock::now();
    std::chrono::microseconds nap(20);
    while (r == ncclInProgress) {
      if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) r = ncclInternalError;
      if (r != ncclInProgress) break;
      if (elapsed(start) > timeout_s_) return time_out(what);
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(2000));
    }
    if (r != ncclSuccess)
      return distgemm::fail(DG_ERROR_CUDA, distgemm::cat(caller_, ": ", what, ": ", nccl_message(comm_, r)));
    return DG_SUCCESS;
  }

  // Waits (bounded) until what this step enqueued on the stream has run. Two events, not the
  // stream: work queued on it before the step (the caller's, however long) only delays the
  // clock's start (bounded by timeout_s on its own), and work queued after it (another thread's)
  // is not waited for.
  dg_status wait(const char* what) {
    DG_RETURN_IF_ERROR(events());
    DG_CUDA_RETURN(cudaEventRecord(after_, stream_));
    if (before_recorded_) DG_RETURN_IF_ERROR(poll(before_, what, "the stream's earlier work"));
    before_recorded_ = false;
    return poll(after_, what, nullptr);
  }

  // One collective enqueued on the stream (then wait() for it).
  dg_status all_reduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                       const char* what) {
    DG_RETURN_IF_ERROR(mark());
    return enqueued(ncclAllReduce(send, recv, count, type, op, comm_, stream_), what);
  }
  dg_status all_gather(const void* send, void* recv, size_t bytes, const char* what) {
    DG_RETURN_IF_ERROR(mark());
    return enqueued(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_), what);
  }

 private:
  dg_status events() {
    if (!before_) DG_CUDA_RETURN(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
    if (!after_) DG_CUDA_RETURN(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
    return DG_SUCCESS;
  }
  // Where the step's own work begins on the stream (its first collective), once per step.
  dg_status mark() {
    if (before_recorded_) return DG_SUCCESS;
    DG_RETURN_IF_ERROR(events());
    DG_CUDA_RETURN(cudaEventRecord(before_, stream_));
    before_recorded_ = true;
    return DG_SUCCESS;
  }

  // Polls `event` until it completes, an NCCL asynchronous error (which aborts the
  // communicator) or timeout_s; `earlier` names the work it waits for when that is not the step.
  dg_status poll(cudaEvent_t event, const char* what, const char* earlier) {
    const auto start = std::chrono::steady_clock::now();
    std::chrono::microseconds nap(20);
    for (;;) {
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) return DG_SUCCESS;
      if (e != cudaErrorNotReady)
        return distgemm::fail(DG_ERROR_CUDA,
                              distgemm::cat(caller_, ": ", what, ": cudaEventQuery: ", cudaGetErrorString(e)));
      ncclResult_t async = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &async);
      if (q != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        const ncclResult_t r = q != ncclSuccess ? q : async;
        const std::string m = nccl_message(comm_, r);
        abort();
        return distgemm::fail(DG_ERROR_CUDA,
                              distgemm::cat(caller_, ": ", what, ": NCCL asynchronous error: ", m,
                                            "; the communicator was aborted (ncclCommAbort, which freed it) "
                                            "and must be recreated"));
      }
      if (elapsed(start) > timeout_s_)
        return earlier ? time_out(distgemm::cat(what, " (waiting for ", earlier, ")").c_str()) : time_out(what);
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(2000));
    }
  }

  static double elapsed(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  void abort() {
    if (!aborted_) ncclCommAbort(comm_);
    aborted_ = true;
  }
  dg_status time_out(const char* what) {
    abort();
    return distgemm::fail(DG_ERROR_TIMEOUT, distgemm::cat(caller_, ": ", what,
                                                          ": the peers did not answer within timeout_s = ", timeout_s_,
                                                          " s; the communicator was aborted (ncclCommAbort, which "
                                                          "freed it) and must be recreated"));
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  double timeout_s_;
  const char* caller_;
  bool aborted_ = false;
  cudaEvent_t before_ = nullptr, after_ = nullptr;
  bool before_recorded_ = false;
};

}  // namespace

struct dg_nccl_workspace {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int world = 0;
  int device = 0;
  size_t bytes = 0;
  double timeout_s = 0;
  void* local = nullptr;         // this rank's workspace (cudaMalloc)
  void* barrier = nullptr;       // 256 device bytes for destroy's barriers
  std::vector<void*> peers;      // [world] as mapped here; peers[rank] == local
  std::vector<char> ipc_opened;  // [world] peers[r] came from cudaIpcOpenMemHandle

  // Closes the mappings, then frees this rank's memory (no collective).
  void release() {
    for (size_t r = 0; r < peers.size(); ++r)
      if (ipc_opened[r] && peers[r]) cudaIpcCloseMemHandle(peers[r]);
    peers.clear();
    ipc_opened.clear();
    if (local) cudaFree(local);
    if (barrier) cudaFree(barrier);
    local = barrier = nullptr;
  }
  ~dg_nccl_workspace() { release(); }
};

namespace {

// The exchange buffers of one create: device scratch and its pinned host mirror, (world + 2)
// 128-byte slots: [0] the size, [1] this rank's record, [2..] the gathered records.
struct Staging {
  void* device = nullptr;
  void* host = nullptr;
  size_t bytes = 0;
  ~Staging() {
    if (device) cudaFree(device);
    if (host) cudaFreeHost(host);
  }
  char* dev_slot(int i) const { return static_cast<char*>(device) + 128 * size_t(i); }
  char* host_slot(int i) const { return static_cast<char*>(host) + 128 * size_t(i); }
};

// Every rank's `bytes` at `mine` to every rank, through the staging: rank r's land in host slot
// 2 + r * bytes / 128 onwards (bytes * world in all), after a bounded wait.
dg_status all_gather_host(Collectives& coll, const Staging& st, const void* mine, size_t bytes, int world,
                          cudaStream_t stream, const char* what) {
  std::memcpy(st.host_slot(1), mine, bytes);
  DG_CUDA_RETURN(cudaMemcpyAsync(st.dev_slot(1), st.host_slot(1), bytes, cudaMemcpyHostToDevice, stream));
  DG_RETURN_IF_ERROR(coll.all_gather(st.dev_slot(1), st.dev_slot(2), bytes, what));
  DG_CUDA_RETURN(
      cudaMemcpyAsync(st.host_slot(2), st.dev_slot(2), bytes * size_t(world), cudaMemcpyDeviceToHost, stream));
  return coll.wait(what);
}

// Allocates, zeroes and exports this rank's workspace into `mine`; a failure leaves mine.ok 0
// and its message in dg_last_error, and the caller still takes part in the exchange.
dg_status prepare_local(dg_nccl_workspace* ws, cudaStream_t stream, Record* mine) {
  std::memset(mine, 0, sizeof(*mine));
  mine->process = process_token();
  mine->device = ws->device;
  DG_CUDA_RETURN(cudaMalloc(&ws->local, ws->bytes));
  DG_CUDA_RETURN(cudaMemsetAsync(ws->local, 0, ws->bytes, stream));
  DG_CUDA_RETURN(cudaIpcGetMemHandle(&mine->handle, ws->local));
  mine->address = reinterpret_cast<uintptr_t>(ws->local);
  mine->ok = 1;
  return DG_SUCCESS;
}

// Maps peer r's workspace from its record.
dg_status map_peer(dg_nccl_workspace* ws, int r, const Record& rec) {
  if (rec.process == process_token()) {  // a GPU this process drives too: same address space
    if (rec.device != ws->device) {
      const cudaError_t e = cudaDeviceEnablePeerAccess(rec.device, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else if (e != cudaSuccess) {
        return distgemm::fail(DG_ERROR_CUDA, distgemm::cat("cudaDeviceEnablePeerAccess(", rec.device, ") for rank ", r,
                                                           ": ", cudaGetErrorString(e)));
      }
    }
    ws->peers[r] = reinterpret_cast<void*>(static_cast<uintptr_t>(rec.address));
    return DG_SUCCESS;
  }
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, rec.handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess)
    return distgemm::fail(DG_ERROR_CUDA,
                          distgemm::cat("cudaIpcOpenMemHandle of rank ", r, "'s workspace: ", cudaGetErrorString(e)));
  ws->peers[r] = p;
  ws->ipc_opened[r] = 1;
  return DG_SUCCESS;
}

// The first rank whose int32 flag (stride `stride` bytes from `base`) is 0, or -1.
int first_failed(const char* base, size_t stride, int world) {
  for (int r = 0; r < world; ++r) {
    int32_t ok = 0;
    std::memcpy(&ok, base + stride * size_t(r), sizeof(ok));
    if (!ok) return r;
  }
  return -1;
}

dg_status create(ncclComm_t comm, size_t bytes, double timeout_s, cudaStream_t stream, dg_nccl_workspace** out) {
  const char* const fn = "dg_nccl_workspace_create";
  DG_REQUIRE(out != nullptr, fn, ": out must not be NULL");
  *out = nullptr;
  DG_REQUIRE(comm != nullptr, fn, ": comm must not be NULL");
  DG_REQUIRE(bytes > 0, fn, ": bytes must be positive (e.g. dg_tp_workspace_size's), got 0");
  DG_REQUIRE(bytes <= SIZE_MAX - kGranularity, fn, ": bytes = ", bytes, " is too large");
  DG_REQUIRE(std::isfinite(timeout_s) && timeout_s > 0, fn,
             ": timeout_s must be a finite positive number of seconds, got ", timeout_s);

  DeviceGuard guard;  // restores the caller's device after ws and the staging are freed
  auto ws = std::make_unique<dg_nccl_workspace>();
  ws->comm = comm;
  ws->timeout_s = timeout_s;
  ncclResult_t r = ncclCommCount(comm, &ws->world);
  if (r != ncclSuccess)
    return distgemm::fail(DG_ERROR_CUDA, distgemm::cat(fn, ": ncclCommCount: ", nccl_message(comm, r)));
  r = ncclCommUserRank(comm, &ws->rank);
  if (r != ncclSuccess)
    return distgemm::fail(DG_ERROR_CUDA, distgemm::cat(fn, ": ncclCommUserRank: ", nccl_message(comm, r)));
  r = ncclCommCuDevice(comm, &ws->device);
  if (r != ncclSuccess)
    return distgemm::fail(DG_ERROR_CUDA, distgemm::cat(fn, ": ncclCommCuDevice: ", nccl_message(comm, r)));
  DG_REQUIRE(ws->world >= kMinWorld && ws->world <= kMaxWorld, fn, ": comm has ", ws->world,
             " ranks; the tensor-parallel GEMMs need ", kMinWorld, " to ", kMaxWorld);

  DG_RETURN_IF_ERROR(guard.enter(ws->device));
  Collectives coll(comm, stream, timeout_s, fn);
  const int world = ws->world;

  // 256 device bytes first: destroy's barriers, and the buffer with which a rank whose staging
  // cannot be allocated still joins the first collective, so that its peers learn at once
  // instead of waiting out timeout_s (without even these, nothing can join: the peers time out).
  DG_CUDA_RETURN(cudaMalloc(&ws->barrier, 256));
  Staging st;
  st.bytes = 128 * size_t(world + 2);
  cudaError_t staging = cudaMalloc(&st.device, st.bytes);
  if (staging == cudaSuccess) staging = cudaMallocHost(&st.host, st.bytes);
  if (staging != cudaSuccess) {
    cudaGetLastError();
    DG_CUDA_RETURN(cudaMemsetAsync(ws->barrier, 0xff, sizeof(uint64_t), stream));  // kFailedSize
    DG_RETURN_IF_ERROR(
        coll.all_reduce(ws->barrier, ws->barrier, 1, ncclUint64, ncclMax, "ncclAllReduce (max) of the workspace size"));
    DG_RETURN_IF_ERROR(coll.wait("ncclAllReduce (max) of the workspace size"));
    return distgemm::fail(DG_ERROR_CUDA, distgemm::cat(fn, ": rank ", ws->rank, ": allocating the ", st.bytes,
                                                       "-byte exchange staging failed: ", cudaGetErrorString(staging)));
  }

  // 1. The size: the largest request of any rank, in whole granules (kFailedSize: a rank could
  // not allocate its staging).
  const uint64_t want = (bytes + kGranularity - 1) / kGranularity * kGranularity;
  std::memcpy(st.host_slot(0), &want, sizeof(want));
  DG_CUDA_RETURN(cudaMemcpyAsync(st.dev_slot(0), st.host_slot(0), sizeof(want), cudaMemcpyHostToDevice, stream));
  DG_RETURN_IF_ERROR(coll.all_reduce(st.dev_slot(0), st.dev_slot(0), 1, ncclUint64, ncclMax,
                                     "ncclAllReduce (max) of the workspace size"));
  DG_CUDA_RETURN(cudaMemcpyAsync(st.host_slot(0), st.dev_slot(0), sizeof(want), cudaMemcpyDeviceToHost, stream));
  DG_RETURN_IF_ERROR(coll.wait("ncclAllReduce (max) of the workspace size"));
  uint64_t agreed = 0;
  std::memcpy(&agreed, st.host_slot(0), sizeof(agreed));
  if (agreed == kFailedSize)
    return distgemm::fail(DG_ERROR_CUDA, distgemm::cat(fn,
                                                       ": a peer could not allocate its exchange staging "
                                                       "(its dg_last_error says why)"));
  ws->bytes = static_cast<size_t>(agreed);

  // 2. Allocate, zero and export; every rank's record (handle and whether it succeeded) to all.
  Record mine;
  const dg_status local_status = prepare_local(ws.get(), stream, &mine);
  const std::string local_error = local_status == DG_SUCCESS ? std::string() : dg_last_error();
  DG_RETURN_IF_ERROR(
      all_gather_host(coll, st, &mine, sizeof(mine), world, stream, "ncclAllGather of the workspaces' IPC handles"));
  // The gather completing means every rank's zeroing (enqueued before it) has run.
  std::vector<Record> records(world);
  std::memcpy(records.data(), st.host_slot(2), sizeof(Record) * size_t(world));
  if (local_status != DG_SUCCESS)
    return distgemm::fail(local_status, distgemm::cat(fn, ": rank ", ws->rank, ": ", local_error));
  const int bad =
      first_failed(reinterpret_cast<const char*>(records.data()) + offsetof(Record, ok), sizeof(Record), world);
  if (bad >= 0)
    return distgemm::fail(DG_ERROR_CUDA, distgemm::cat(fn, ": rank ", bad, " could not allocate or export its ",
                                                       ws->bytes, "-byte workspace (its dg_last_error says why)"));

  // 3. Map every peer's; then meet: each rank learns whether all could map.
  ws->peers.assign(world, nullptr);
  ws->ipc_opened.assign(world, 0);
  ws->peers[ws->rank] = ws->local;
  dg_status map_status = DG_SUCCESS;
  std::string map_error;
  for (int p = 0; p < world && map_status == DG_SUCCESS; ++p) {
    if (p == ws->rank) continue;
    map_status = map_peer(ws.get(), p, records[p]);
    if (map_status != DG_SUCCESS) map_error = dg_last_error();
  }
  const int32_t mapped = map_status == DG_SUCCESS;
  DG_RETURN_IF_ERROR(
      all_gather_host(coll, st, &mapped, sizeof(mapped), world, stream, "ncclAllGather of the ranks' mapping results"));
  const int unmapped = first_failed(st.host_slot(2), sizeof(int32_t), world);
  if (unmapped < 0) {
    *out = ws.release();
    return DG_SUCCESS;
  }
  // Every rank is here (each saw the same results): the peers that mapped this rank's memory
  // close their mappings before anyone frees what it exported (freeing memory another process
  // still has open is undefined). Without that barrier the memory is left allocated.
  const std::string message =
      map_status != DG_SUCCESS
          ? distgemm::cat(fn, ": rank ", ws->rank, ": ", map_error)
          : distgemm::cat(fn, ": rank ", unmapped, " could not map its peers' workspaces (its dg_last_error says why)");
  for (int r = 0; r < world; ++r)
    if (ws->ipc_opened[r] && ws->peers[r]) cudaIpcCloseMemHandle(ws->peers[r]);
  ws->peers.clear();
  ws->ipc_opened.clear();
  DG_CUDA_RETURN(cudaMemsetAsync(ws->barrier, 0, sizeof(int32_t), stream));
  dg_status closed =
      coll.all_reduce(ws->barrier, ws->barrier, 1, ncclInt32, ncclSum, "barrier after closing the mappings");
  if (closed == DG_SUCCESS) closed = coll.wait("barrier after closing the mappings");
  if (closed != DG_SUCCESS) ws->local = nullptr;  // a peer may still map it: leaked, not freed
  return distgemm::fail(map_status != DG_SUCCESS ? map_status : DG_ERROR_CUDA, message);
}

}  // namespace

extern "C" dg_status dg_nccl_workspace_create(ncclComm_t comm, size_t bytes, double timeout_s, cudaStream_t stream,
                                              dg_nccl_workspace** out) {
  return create(comm, bytes, timeout_s, stream, out);
}

extern "C" dg_status dg_nccl_workspace_destroy(dg_nccl_workspace* ws, cudaStream_t stream) {
  if (ws == nullptr) return DG_SUCCESS;
  const char* const fn = "dg_nccl_workspace_destroy";
  DeviceGuard guard;  // declared first: restores the caller's device after ws is freed
  std::unique_ptr<dg_nccl_workspace> owned(ws);
  DG_RETURN_IF_ERROR(guard.enter(ws->device));
  Collectives coll(ws->comm, stream, ws->timeout_s, fn);
  int* flag = static_cast<int*>(ws->barrier);
  // Until barrier 2 completes a peer may still write into this rank's memory, and until barrier
  // 1 completes this rank's own queued calls may still use the peers': a failure before then
  // leaves the mappings and the memory as they are (leaked, never handed back to the allocator
  // while something may write into them); the handle itself is freed.
  auto keep_memory = [&](dg_status status) {
    ws->peers.clear();
    ws->ipc_opened.clear();
    ws->local = ws->barrier = nullptr;
    return status;
  };
  // Barrier 1: every rank's calls on its workspace and its peers' (enqueued earlier on stream) are
  // done. Then the mappings close; barrier 2: no rank still maps this rank's memory when it is freed.
  dg_status s = coll.all_reduce(flag, flag, 1, ncclInt32, ncclSum, "barrier before unmapping");
  if (s == DG_SUCCESS) s = coll.wait("barrier before unmapping");
  if (s != DG_SUCCESS) return keep_memory(s);
  for (int r = 0; r < ws->world; ++r) {
    if (ws->ipc_opened[r] && ws->peers[r]) {
      const cudaError_t e = cudaIpcCloseMemHandle(ws->peers[r]);
      ws->ipc_opened[r] = 0;
      if (e != cudaSuccess)
        return keep_memory(distgemm::fail(DG_ERROR_CUDA, distgemm::cat(fn, ": cudaIpcCloseMemHandle of rank ", r,
                                                                       "'s workspace: ", cudaGetErrorString(e))));
    }
  }
  s = coll.all_reduce(flag, flag, 1, ncclInt32, ncclSum, "barrier before freeing");
  if (s == DG_SUCCESS) s = coll.wait("barrier before freeing");
  if (s != DG_SUCCESS) return keep_memory(s);
  void* local = ws->local;
  void* barrier = ws->barrier;
  ws->local = ws->barrier = nullptr;
  ws->release();
  DG_CUDA_RETURN(cudaFree(local));
  DG_CUDA_RETURN(cudaFree(barrier));
  return DG_SUCCESS;
}

extern "C" dg_status dg_nccl_tp_bind(const dg_nccl_workspace* ws, dg_tp_desc* desc) {
  DG_REQUIRE(ws != nullptr, "dg_nccl_tp_bind: ws must not be NULL");
  DG_REQUIRE(desc != nullptr, "dg_nccl_tp_bind: desc must not be NULL");
  desc->rank = ws->rank;
  desc->world = ws->world;
  desc->peer_workspaces = ws->peers.data();
  desc->workspace_bytes = ws->bytes;
  return DG_SUCCESS;
}

extern "C" size_t dg_nccl_workspace_bytes(const dg_nccl_workspace* ws) { return ws ? ws->bytes : 0; }
