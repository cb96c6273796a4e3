// The emulator's launcher: runs a kernel's grid on the calling thread, each block's threads
// as fibers (see shim.h), and the registry of every `extern "C" __global__` kernel by name
// with its parameter signature.
//
// A GPU runs a grid's blocks in no set order, and a block's warps in no set order between its
// barriers. So the emulator does not run them in index order either: blocks run in a shuffled
// order and, in every round between barriers, the ready threads resume in a shuffled order.
// A kernel that reads what another block (or another thread before a barrier) writes then
// computes something else than its CPU twin, and its emulation test fails, instead of passing
// by the accident of index order. The shuffles are seeded from the kernel's name and launch
// shape (and `MW_EMU_SEED`), so the same launch always runs the same way — float atomics
// stay reproducible — and `MW_EMU_SEED=0` runs everything in index order, for debugging. Included once, after the kernel sources, by the build of the
// memwise-cuda-emu crate (kernels/cuda-emu), which generates `registry.inc`.

#ifndef MW_EMU_RUNTIME_H
#define MW_EMU_RUNTIME_H

#include <cstdio>
#include <cstdlib>
#include <string>
#include <ucontext.h>
#include <utility>
#include <vector>

namespace mw_emu {

enum class St : unsigned char { Ready, WaitBlock, WaitWarp, Done, Failed };

struct Fiber {
    ucontext_t ctx;
    St st;
    uint3 tid;
};

// splitmix64: the shuffles' generator.
inline unsigned long long mix(unsigned long long& s) {
    s += 0x9E3779B97F4A7C15ull;
    unsigned long long z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Fisher–Yates over v with the generator `s`; `s == 0` leaves v in order.
template <typename T> inline void shuffle(std::vector<T>& v, unsigned long long& s) {
    if (s == 0) return;
    for (size_t i = v.size(); i > 1; i--) std::swap(v[i - 1], v[mix(s) % i]);
}

// The launch's schedule seed: `MW_EMU_SEED` (default 1; 0 = index order) mixed with the
// kernel's name and launch shape.
inline unsigned long long schedule_seed(const char* name, const unsigned grid[3],
                                        const unsigned block[3]) {
    const char* env = std::getenv("MW_EMU_SEED");
    unsigned long long base = env ? std::strtoull(env, nullptr, 10) : 1;
    if (base == 0) return 0;
    unsigned long long h = 0xcbf29ce484222325ull ^ base;
    for (const char* c = name; *c; c++) h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
    for (int i = 0; i < 3; i++) h = (h ^ grid[i]) * 0x100000001b3ull;
    for (int i = 0; i < 3; i++) h = (h ^ block[i]) * 0x100000001b3ull;
    return h | 1; // never 0, which means "in order"
}

struct Launch {
    ucontext_t sched;
    std::vector<Fiber> f;
    std::vector<char*> stacks;
    unsigned cur = 0, n = 0;
    void (*body)(void**) = nullptr;
    void** args = nullptr;
    std::vector<unsigned long long> slots; // one 8-byte exchange slot per thread
    std::string error;
    unsigned long long seed = 0; // the schedule's generator (0: index order)
    std::vector<unsigned> order; // this round's thread order
};

inline thread_local Launch* L = nullptr;
constexpr size_t kStack = 128 * 1024;

inline void park(St s) {
    Fiber& me = L->f[L->cur];
    me.st = s;
    swapcontext(&me.ctx, &L->sched);
}

[[noreturn]] inline void fail(const std::string& msg) {
    L->error = msg;
    Fiber& me = L->f[L->cur];
    me.st = St::Failed;
    swapcontext(&me.ctx, &L->sched);
    std::abort(); // never resumed
}

inline void sync_block() {
    if (!L) { std::fprintf(stderr, "__syncthreads outside a launch\n"); std::abort(); }
    park(St::WaitBlock);
}
inline void sync_warp() {
    if (!L) { std::fprintf(stderr, "warp sync outside a launch\n"); std::abort(); }
    park(St::WaitWarp);
}

inline void exchange(const void* v, unsigned size, int lane_xor, int lane_down, void* out) {
    if (size > 8) fail("warp shuffle of a value wider than 8 bytes");
    unsigned t = L->cur;
    std::memcpy(&L->slots[t], v, size);
    sync_warp();
    unsigned lane = t & 31u, base = t - lane, src;
    if (lane_xor >= 0) {
        src = base + (lane ^ (unsigned)lane_xor);
    } else {
        unsigned s = lane + (unsigned)lane_down;
        src = s < 32 ? base + s : t;
    }
    if (src >= L->n || L->f[src].st == St::Done) {
        char m[160];
        std::snprintf(m, sizeof m,
                      "thread %u: warp shuffle reads lane %u, which %s (block of %u threads)", t,
                      src & 31u, src >= L->n ? "does not exist" : "has exited", L->n);
        fail(m);
    }
    std::memcpy(out, &L->slots[src], size);
    sync_warp();
}

inline void entry() {
    L->body(L->args);
    L->f[L->cur].st = St::Done;
    // returns to uc_link = the scheduler
}

inline const char* state_name(St s) {
    switch (s) {
    case St::Ready: return "running";
    case St::WaitBlock: return "at __syncthreads";
    case St::WaitWarp: return "at a warp shuffle";
    case St::Done: return "exited";
    default: return "failed";
    }
}

// Runs one block to completion; false (and L->error) when it fails or deadlocks.
inline bool run_block(Launch& l) {
    for (unsigned t = 0; t < l.n; t++) {
        Fiber& f = l.f[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = l.stacks[t];
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = &l.sched;
        makecontext(&f.ctx, entry, 0);
        f.st = St::Ready;
    }
    l.order.resize(l.n);
    while (true) {
        for (unsigned t = 0; t < l.n; t++) l.order[t] = t;
        shuffle(l.order, l.seed);
        for (unsigned t : l.order) {
            if (l.f[t].st != St::Ready) continue;
            l.cur = t;
            threadIdx = l.f[t].tid;
            swapcontext(&l.sched, &l.f[t].ctx);
            if (!l.error.empty()) return false;
        }
        unsigned live = 0, at_block = 0;
        for (unsigned t = 0; t < l.n; t++) {
            if (l.f[t].st != St::Done) live++;
            if (l.f[t].st == St::WaitBlock) at_block++;
        }
        if (live == 0) return true;
        bool released = false;
        for (unsigned w0 = 0; w0 < l.n; w0 += 32) {
            unsigned w1 = w0 + 32 < l.n ? w0 + 32 : l.n, lw = 0, ww = 0;
            for (unsigned t = w0; t < w1; t++) {
                if (l.f[t].st != St::Done) lw++;
                if (l.f[t].st == St::WaitWarp) ww++;
            }
            if (lw > 0 && ww == lw) {
                for (unsigned t = w0; t < w1; t++)
                    if (l.f[t].st == St::WaitWarp) l.f[t].st = St::Ready;
                released = true;
            }
        }
        if (!released && at_block == live) {
            for (unsigned t = 0; t < l.n; t++)
                if (l.f[t].st == St::WaitBlock) l.f[t].st = St::Ready;
            released = true;
        }
        if (!released) {
            std::string m = "deadlock in block (" + std::to_string(blockIdx.x) + ", " +
                            std::to_string(blockIdx.y) + ", " + std::to_string(blockIdx.z) +
                            "): threads wait at different barriers:";
            for (unsigned t = 0; t < l.n && t < 64; t++) {
                if (t % 8 == 0) m += "\n ";
                m += " " + std::to_string(t) + ":" + state_name(l.f[t].st);
            }
            l.error = m;
            return false;
        }
    }
}

inline int launch(const char* name, const unsigned grid[3], const unsigned block[3],
                  void (*body)(void**), void** args, std::string& err) {
    Launch l;
    l.seed = schedule_seed(name, grid, block);
    l.n = block[0] * block[1] * block[2];
    if (l.n == 0 || l.n > 1024) {
        err = "block of " + std::to_string(l.n) + " threads (CUDA allows 1 to 1024)";
        return 1;
    }
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
        err = "empty grid";
        return 1;
    }
    l.body = body;
    l.args = args;
    l.f.resize(l.n);
    l.slots.assign(l.n, 0);
    l.stacks.resize(l.n);
    for (unsigned t = 0; t < l.n; t++) {
        l.stacks[t] = static_cast<char*>(std::malloc(kStack));
        l.f[t].tid = uint3{t % block[0], (t / block[0]) % block[1], t / (block[0] * block[1])};
    }
    Launch* saved = L;
    L = &l;
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{block[0], block[1], block[2]};
    std::vector<uint3> blocks;
    blocks.reserve((size_t)grid[0] * grid[1] * grid[2]);
    for (unsigned z = 0; z < grid[2]; z++)
        for (unsigned y = 0; y < grid[1]; y++)
            for (unsigned x = 0; x < grid[0]; x++) blocks.push_back(uint3{x, y, z});
    shuffle(blocks, l.seed);
    bool ok = true;
    for (size_t b = 0; ok && b < blocks.size(); b++) {
        blockIdx = blocks[b];
        ok = run_block(l);
    }
    L = saved;
    for (char* s : l.stacks) std::free(s);
    if (!ok) {
        err = l.error;
        return 1;
    }
    return 0;
}

// ---- the registry --------------------------------------------------------------------------

template <typename A> std::string code() {
    if constexpr (std::is_pointer_v<A>) return "p";
    else if constexpr (std::is_same_v<A, float>) return "f";
    else if constexpr (std::is_same_v<A, double>) return "d";
    else if constexpr (std::is_same_v<A, int>) return "i";
    else if constexpr (std::is_same_v<A, unsigned>) return "u";
    else if constexpr (std::is_same_v<A, long long>) return "q";
    else if constexpr (std::is_same_v<A, unsigned long long>) return "Q";
    else return "s" + std::to_string(sizeof(A));
}

template <typename F> struct Thunk;
template <typename... A> struct Thunk<void (*)(A...)> {
    template <void (*K)(A...), size_t... I>
    static void call_impl(void** args, std::index_sequence<I...>) {
        K(*static_cast<std::remove_cv_t<A>*>(args[I])...);
    }
    template <void (*K)(A...)> static void call(void** args) {
        call_impl<K>(args, std::index_sequence_for<A...>{});
    }
    static std::string sig() {
        std::string s;
        ((s += (s.empty() ? "" : ","), s += code<std::remove_cv_t<A>>()), ...);
        return s;
    }
};

struct Entry {
    const char* name;
    void (*call)(void**);
    std::string (*sig)();
};

#define MW_EMU_REG(k) {#k, &mw_emu::Thunk<decltype(&k)>::template call<&k>, &mw_emu::Thunk<decltype(&k)>::sig},
inline const Entry REGISTRY[] = {
#include "registry.inc"
};
#undef MW_EMU_REG

inline void copy_err(const std::string& s, char* err, unsigned long len) {
    if (!err || len == 0) return;
    std::snprintf(err, len, "%s", s.c_str());
}

} // namespace mw_emu

extern "C" unsigned mw_emu_kernel_count() {
    return sizeof(mw_emu::REGISTRY) / sizeof(mw_emu::REGISTRY[0]);
}
extern "C" const char* mw_emu_kernel_name(unsigned i) { return mw_emu::REGISTRY[i].name; }
extern "C" int mw_emu_kernel_sig(unsigned i, char* out, unsigned long len) {
    mw_emu::copy_err(mw_emu::REGISTRY[i].sig(), out, len);
    return 0;
}

// Launches kernel `name` over `grid` × `block` with `args` (one pointer per parameter, as
// cuLaunchKernel takes them). `sig` is the caller's idea of the parameters ("p,Q,f,s48"…); a
// mismatch with the kernel's is an error, as is an unknown name, a bad shape or a deadlock.
extern "C" int mw_emu_launch(const char* name, const unsigned grid[3], const unsigned block[3],
                             void** args, const char* sig, char* err, unsigned long errlen) {
    for (const mw_emu::Entry& e : mw_emu::REGISTRY) {
        if (std::strcmp(e.name, name) != 0) continue;
        std::string want = e.sig();
        if (sig && want != sig) {
            mw_emu::copy_err(std::string(name) + ": the kernel takes (" + want +
                                 ") but was given (" + sig + ")",
                             err, errlen);
            return 1;
        }
        std::string m;
        if (mw_emu::launch(name, grid, block, e.call, args, m) != 0) {
            mw_emu::copy_err(std::string(name) + ": " + m, err, errlen);
            return 1;
        }
        return 0;
    }
    mw_emu::copy_err(std::string("no kernel named ") + name, err, errlen);
    return 1;
}

#endif // MW_EMU_RUNTIME_H
