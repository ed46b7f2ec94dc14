// QuantMLA CuPy backend: thread-block cluster helpers (sm_90): distributed shared memory and mbarriers.
//
// Addresses are 32-bit shared-window addresses (common.cuh's smem_addr). A CTA's own shared::cta address is a
// valid shared::cluster address of its own memory; mapa gives the same offset in another CTA of the cluster, and
// the windows are linear, so a peer's address is the local one plus a fixed delta (cluster_peer_delta).
// Included after common.cuh (u32); nothing about the page layout is typed here.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "cluster.cuh needs sm_90"
#endif

__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// add this to a local shared address to reach the same byte in CTA `rank` of the cluster
__device__ __forceinline__ u32 cluster_peer_delta(u32 local_base, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_base), "r"(rank));
    return remote - local_base;
}

// loads from shared::cluster address `addr` (this CTA's or a peer's), after the writer's cluster barrier: volatile
// keeps them after that barrier's asm; without a memory clobber the compiler may still issue many before the first
// is used
__device__ __forceinline__ float ld_cluster_f32(u32 addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ float4 ld_cluster_f32x4(u32 addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr));
    return v;
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) of this CTA's shared memory at `src` to a peer's
// (shared::cluster address `dst`) by the bulk-copy engine; the peer's mbarrier at `mbar` (shared::cluster) counts
// them as they land (complete_tx). It reads `src` through the async proxy: fence the stores that wrote it first.
__device__ __forceinline__ void bulk_copy_to_peer(u32 dst, u32 src, u32 bytes, u32 mbar) {
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "r"(src), "r"(bytes), "r"(mbar)
                 : "memory");
}

// every thread of every CTA of the cluster: arrive (release) and wait (acquire)
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void mbar_init(u32 addr, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(count) : "memory");
}

// the initialized mbarriers visible to the cluster (then a cluster barrier, before any CTA uses them)
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// one arrival on an mbarrier at shared::cluster address `addr` (this CTA's or a peer's)
__device__ __forceinline__ void mbar_arrive(u32 addr) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(addr) : "memory");
}

// one arrival on this CTA's mbarrier at `addr` that also expects `tx` more bytes to land (st_async_v4)
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 addr, u32 tx) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], %1;" ::"r"(addr), "r"(tx) : "memory");
}

// waits until the phase of parity `parity` of this CTA's mbarrier at `addr` has completed
__device__ __forceinline__ void mbar_wait(u32 addr, u32 parity) {
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra WAIT_%=;\n}" ::"r"(addr),
        "r"(parity)
        : "memory");
}
