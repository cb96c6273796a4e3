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
// stay reproducible — and `MW_EMU_SEED=0` runs everything in index order, for debugging.
//
// Two stricter checks catch what one lucky schedule hides:
// - shared memory is filled with 0xFF bytes (NaN) in every block before its first use
//   (`shared_decl`, called from each `__shared__` declaration: kernels/cuda-emu/build.rs);
// - with `MW_EMU_RACES=1` (or `mw_emu_check_races(1)` on the calling thread) a launch logs
//   every load and store the kernel code makes — through the `__tsan_*` hooks at the end of
//   this file, which GCC's `-fsanitize=thread` instrumentation calls — and fails on the first
//   data race: two accesses to one byte, at least one a write, by different threads that
//   nothing orders. Blocks never synchronise within a launch; within a block a
//   `__syncthreads` orders everything before it before everything after it, and a
//   `__syncwarp` does the same for the lanes of its warp (CUDA makes it a memory barrier
//   among them; a shuffle is not one). Each thread's own stack and the built-in index
//   variables are not logged; atomics are exempt (shim.h). Which access came first does not
//   matter: the log keeps, per byte, the last write and a summary of the reads since, enough
//   to flag every unordered pair whatever order the shuffle ran them in.
//
// Included once, after the kernel sources, by the build of the memwise-cuda-emu crate
// (kernels/cuda-emu), which generates `registry.inc`.

#ifndef MW_EMU_RUNTIME_H
#define MW_EMU_RUNTIME_H

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <ucontext.h>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mw_emu {

enum class St : unsigned char { Ready, WaitBlock, WaitWarp, Done, Failed };

struct Fiber {
    ucontext_t ctx;
    St st;
    uint3 tid;
    bool fence; // waits at a __syncwarp (not a shuffle's exchange)
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

// One byte's history in the race log: the last write, and the reads since it summarised as
// much as a later write needs to know whether it conflicts with one of them. Blocks are
// numbered linearly, threads by their index in the block, `epoch` counts the launch's block
// starts and __syncthreads releases, and `ws` a warp's __syncwarp releases: two accesses of
// one block are ordered when their epochs differ, or when they come from one warp and their
// `ws` differ.
struct Cell {
    unsigned wblk, wthr, wep, wws; // the last write: block, thread, epoch, warp syncs
    unsigned rblk, rthr, rep, rws; // reads: block (when one), latest epoch, its first reader
                                   // and the most warp syncs any of its reads had seen
    unsigned char w;               // a write is logged
    unsigned char r;               // reads since it: 0 none, 1 all from block rblk, 2 several
    unsigned char rmany;           // several threads read in epoch rep
    unsigned char rwarps;          // … from several warps
};

struct SharedVar {
    const unsigned char* p;
    unsigned long size;
    const char* name;
};

struct RaceLog {
    static constexpr unsigned kPage = 4096;
    std::unordered_map<unsigned long, std::unique_ptr<Cell[]>> pages;
    unsigned long last_page = ~0ul;
    Cell* last = nullptr;
    std::vector<std::pair<const unsigned char*, unsigned>> params; // pointer parameters, index
    std::string race;                                               // the first race found

    Cell& cell(unsigned long a) {
        unsigned long pg = a / kPage;
        if (pg != last_page) {
            std::unique_ptr<Cell[]>& c = pages[pg];
            if (!c) c.reset(new Cell[kPage]()); // zeroed: no access yet
            last_page = pg;
            last = c.get();
        }
        return last[a % kPage];
    }
    // Forgets the bytes [p, p + n): a new block's shared variable is new memory.
    void forget(const unsigned char* p, unsigned long n) {
        for (unsigned long a = (unsigned long)p; a < (unsigned long)p + n; a++) {
            auto it = pages.find(a / kPage);
            if (it != pages.end()) it->second[a % kPage] = Cell{};
        }
        last_page = ~0ul;
    }
};

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
    std::vector<SharedVar> shared; // the running block's shared variables, filled so far
    unsigned blk = 0;                 // the running block, numbered linearly
    unsigned epoch = 0;               // see Cell
    std::vector<unsigned> ws;         // each warp's __syncwarp releases (see Cell)
    std::unique_ptr<RaceLog> log;     // null unless this launch checks for races
};

inline thread_local Launch* L = nullptr;
constexpr size_t kStack = 128 * 1024;

// Whether the running fiber's accesses go to the race log: set by the scheduler around each
// resumption of a fiber of a checked launch, cleared while the log itself (or any other
// emulator code that the instrumentation sees) runs.
inline thread_local bool g_log = false;
// mw_emu_check_races on this OS thread: -1 leaves it to MW_EMU_RACES.
inline thread_local int g_races = -1;

// Pauses the race log for the emulator's own work inside a fiber.
struct Unlogged {
    bool saved;
    MW_EMU_UNLOGGED Unlogged() : saved(g_log) { g_log = false; }
    MW_EMU_UNLOGGED ~Unlogged() { g_log = saved; }
};

MW_EMU_UNLOGGED inline void shared_decl(void* p, unsigned long size, const char* name) {
    if (!L) return;
    Unlogged quiet;
    for (const SharedVar& v : L->shared)
        if (v.p == p) return;
    // First use in this block: whatever an earlier block (or nobody) left becomes NaN.
    std::memset(p, 0xff, size);
    L->shared.push_back(SharedVar{static_cast<const unsigned char*>(p), size, name});
    if (L->log) L->log->forget(static_cast<const unsigned char*>(p), size);
}

inline std::string where_block(unsigned b) {
    unsigned x = b % gridDim.x, y = (b / gridDim.x) % gridDim.y, z = b / (gridDim.x * gridDim.y);
    return "block (" + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + ")";
}

// The race message: what memory `a` is, who accesses it now, and the access it conflicts with.
MW_EMU_UNLOGGED inline std::string describe_race(unsigned long a, bool write, const Cell& c,
                                                 bool with_write, const std::vector<Fiber>& f) {
    std::string what;
    for (const SharedVar& v : L->shared)
        if (a >= (unsigned long)v.p && a < (unsigned long)v.p + v.size)
            what = std::string("shared memory `") + v.name + "` byte " +
                   std::to_string(a - (unsigned long)v.p);
    if (what.empty()) {
        // The nearest pointer parameter at or below the address (buffer sizes are unknown).
        const std::pair<const unsigned char*, unsigned>* best = nullptr;
        for (const auto& p : L->log->params)
            if ((unsigned long)p.first <= a && (!best || p.first > best->first)) best = &p;
        what = best ? "global memory at parameter " + std::to_string(best->second) + " + " +
                          std::to_string(a - (unsigned long)best->first) + " bytes"
                    : "global memory";
    }
    auto thr = [&](unsigned t) {
        const uint3& i = f[t].tid;
        return "thread (" + std::to_string(i.x) + "," + std::to_string(i.y) + "," +
               std::to_string(i.z) + ")";
    };
    std::string now = thr(L->cur) + " of " + where_block(L->blk) + (write ? " writes" : " reads");
    std::string before;
    unsigned other_blk;
    if (with_write) {
        before = thr(c.wthr) + " of " + where_block(c.wblk) + " wrote";
        other_blk = c.wblk;
    } else if (c.r == 2) {
        before = "threads of several blocks read";
        other_blk = L->blk + 1;
    } else {
        before = (c.rthr != L->cur || !c.rmany ? thr(c.rthr) : std::string("another thread")) +
                 " of " + where_block(c.rblk) + " read";
        other_blk = c.rblk;
    }
    return "data race on " + what + ": " + now + " it after " + before + " it, " +
           (other_blk != L->blk ? "and the blocks of one launch never synchronise"
                                : "with no __syncthreads between them");
}

// Logs one access of `size` bytes at `p` by the running fiber; records the first race.
MW_EMU_UNLOGGED inline void log_access(const void* p, unsigned long size, bool write) {
    Launch& l = *L;
    RaceLog& g = *l.log;
    unsigned long a0 = (unsigned long)p;
    // The thread's own stack (its locals) is private; the built-in indices are written by the
    // scheduler between fibers only.
    unsigned long s0 = (unsigned long)l.stacks[l.cur];
    const unsigned ws = l.ws[l.cur / 32];
    if (a0 >= s0 && a0 < s0 + kStack) return;
    auto in = [a0](const void* v, unsigned long n) {
        return a0 >= (unsigned long)v && a0 < (unsigned long)v + n;
    };
    if (in(&threadIdx, sizeof threadIdx) || in(&blockIdx, sizeof blockIdx) ||
        in(&blockDim, sizeof blockDim) || in(&gridDim, sizeof gridDim))
        return;
    if (!g.race.empty()) return;
    const unsigned b = l.blk, t = l.cur, e = l.epoch;
    // Accesses (b, t, e, ws) and (b2, t2, e2, ws2) of different threads are unordered when
    // they come from different blocks, or from one block between the same two __syncthreads
    // and not from one warp on either side of a __syncwarp.
    auto unordered = [&](unsigned b2, unsigned t2, unsigned e2, unsigned ws2) {
        return b2 != b || (t2 != t && e2 == e && (t2 / 32 != t / 32 || ws2 == ws));
    };
    for (unsigned long a = a0; a < a0 + size; a++) {
        Cell& c = g.cell(a);
        bool vs_write = c.w && unordered(c.wblk, c.wthr, c.wep, c.wws);
        // The reads of epoch rep are all ordered before this write when this thread made
        // them all, or they all came from its warp before its latest __syncwarp.
        bool reads_before = (!c.rmany && c.rthr == t) ||
                            (!c.rwarps && c.rthr / 32 == t / 32 && c.rws < ws);
        bool vs_read = write && c.r &&
                       (c.r == 2 || c.rblk != b || (c.rep == e && !reads_before));
        if (vs_write || vs_read) {
            g.race = describe_race(a, write, c, vs_write, l.f);
            return;
        }
        if (write) {
            // Every read logged so far is ordered before this write, so a later access that
            // conflicts with one of them conflicts with this write too: they can be dropped.
            c.w = 1;
            c.wblk = b;
            c.wthr = t;
            c.wep = e;
            c.wws = ws;
            c.r = 0;
        } else if (c.r == 0 || (c.r == 1 && c.rblk == b && c.rep != e)) {
            // The first read, or the first of a new epoch: an earlier epoch's reads of this
            // block are ordered before anything from now on.
            c.r = 1;
            c.rblk = b;
            c.rep = e;
            c.rthr = t;
            c.rws = ws;
            c.rmany = 0;
            c.rwarps = 0;
        } else if (c.r == 1 && c.rblk != b) {
            c.r = 2;
        } else if (c.r == 1) {
            c.rmany |= c.rthr != t;
            c.rwarps |= c.rthr / 32 != t / 32;
            c.rws = c.rws > ws ? c.rws : ws;
        }
    }
}

MW_EMU_UNLOGGED inline void park(St s) {
    Fiber& me = L->f[L->cur];
    me.st = s;
    g_log = false; // the scheduler sets it again when it resumes this fiber
    swapcontext(&me.ctx, &L->sched);
}

[[noreturn]] MW_EMU_UNLOGGED inline void fail(const std::string& msg) {
    g_log = false;
    L->error = msg;
    Fiber& me = L->f[L->cur];
    me.st = St::Failed;
    swapcontext(&me.ctx, &L->sched);
    std::abort(); // never resumed
}

MW_EMU_UNLOGGED inline void sync_block() {
    if (!L) { std::fprintf(stderr, "__syncthreads outside a launch\n"); std::abort(); }
    park(St::WaitBlock);
}
// A warp barrier: `fence` for a __syncwarp (which orders the lanes' memory accesses), not
// for the exchanges of a shuffle.
MW_EMU_UNLOGGED inline void warp_barrier(bool fence) {
    if (!L) { std::fprintf(stderr, "warp sync outside a launch\n"); std::abort(); }
    L->f[L->cur].fence = fence;
    park(St::WaitWarp);
}
MW_EMU_UNLOGGED inline void sync_warp() { warp_barrier(true); }

MW_EMU_UNLOGGED inline void exchange(const void* v, unsigned size, int lane_xor, int lane_down, void* out) {
    if (size > 8) fail("warp shuffle of a value wider than 8 bytes");
    unsigned t = L->cur;
    std::memcpy(&L->slots[t], v, size);
    warp_barrier(false);
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
    warp_barrier(false);
}

MW_EMU_UNLOGGED inline void entry() {
    L->body(L->args);
    g_log = false;
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

// Runs one block to completion; false (and L->error) when it fails or deadlocks. Unlogged,
// like all the scheduler: its stores to `g_log` and the fibers' states are not the kernel's.
MW_EMU_UNLOGGED inline bool run_block(Launch& l) {
    l.shared.clear();
    l.blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    l.epoch++;
    l.ws.assign((l.n + 31) / 32, 0);
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
            g_log = l.log != nullptr;
            swapcontext(&l.sched, &l.f[t].ctx);
            g_log = false;
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
                bool fence = true;
                for (unsigned t = w0; t < w1; t++)
                    if (l.f[t].st == St::WaitWarp) {
                        l.f[t].st = St::Ready;
                        fence = fence && l.f[t].fence;
                    }
                if (fence) l.ws[w0 / 32]++;
                released = true;
            }
        }
        if (!released && at_block == live) {
            for (unsigned t = 0; t < l.n; t++)
                if (l.f[t].st == St::WaitBlock) l.f[t].st = St::Ready;
            released = true;
            l.epoch++; // what comes after the barrier is ordered after what came before
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

// Whether this launch logs its accesses for races: mw_emu_check_races on this thread, else
// MW_EMU_RACES=1.
inline bool races_wanted() {
    if (g_races >= 0) return g_races != 0;
    const char* env = std::getenv("MW_EMU_RACES");
    return env && std::strcmp(env, "0") != 0 && *env;
}

// `only` (when not null) lists `n_only` blocks (x, y, z triples) to run instead of the whole
// grid: a test of a launch too large to run whole (indices past 2^32 over sparse memory) runs
// the blocks it checks.
MW_EMU_UNLOGGED inline int launch(const char* name, const unsigned grid[3], const unsigned block[3],
                  void (*body)(void**), void** args, const std::string& sig, std::string& err,
                  const unsigned* only, unsigned n_only) {
    for (unsigned b = 0; only && b < n_only; b++) {
        const unsigned* i = only + 3 * b;
        if (i[0] >= grid[0] || i[1] >= grid[1] || i[2] >= grid[2]) {
            err = "block (" + std::to_string(i[0]) + "," + std::to_string(i[1]) + "," +
                  std::to_string(i[2]) + ") is outside the grid";
            return 1;
        }
    }
    Launch l;
    l.seed = schedule_seed(name, grid, block);
    if (races_wanted()) {
#ifndef MW_EMU_RACE_HOOKS
        err = "the race check (MW_EMU_RACES) needs the emulator built by GCC, with its "
              "-fsanitize=thread hooks (kernels/cuda-emu/build.rs)";
        return 1;
#endif
        l.log.reset(new RaceLog);
        // The pointer parameters, to say which buffer a race is in.
        unsigned i = 0;
        for (size_t at = 0; at <= sig.size(); i++) {
            size_t end = sig.find(',', at);
            if (end == std::string::npos) end = sig.size();
            if (sig.compare(at, end - at, "p") == 0)
                l.log->params.emplace_back(*static_cast<const unsigned char* const*>(args[i]), i);
            at = end + 1;
        }
    }
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
    if (only) {
        for (unsigned b = 0; b < n_only; b++)
            blocks.push_back(uint3{only[3 * b], only[3 * b + 1], only[3 * b + 2]});
    } else {
        blocks.reserve((size_t)grid[0] * grid[1] * grid[2]);
        for (unsigned z = 0; z < grid[2]; z++)
            for (unsigned y = 0; y < grid[1]; y++)
                for (unsigned x = 0; x < grid[0]; x++) blocks.push_back(uint3{x, y, z});
    }
    shuffle(blocks, l.seed);
    bool ok = true;
    for (size_t b = 0; ok && b < blocks.size(); b++) {
        blockIdx = blocks[b];
        ok = run_block(l);
        if (ok && l.log && !l.log->race.empty()) {
            l.error = l.log->race;
            ok = false;
        }
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
    // Its __launch_bounds__ (threads per block at most); 0 when it declares none.
    unsigned bound;
};

#define MW_EMU_REG(k, b) {#k, &mw_emu::Thunk<decltype(&k)>::template call<&k>, &mw_emu::Thunk<decltype(&k)>::sig, b},
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
extern "C" unsigned mw_emu_kernel_bound(unsigned i) { return mw_emu::REGISTRY[i].bound; }
extern "C" int mw_emu_kernel_sig(unsigned i, char* out, unsigned long len) {
    mw_emu::copy_err(mw_emu::REGISTRY[i].sig(), out, len);
    return 0;
}

// Launches kernel `name` over `grid` × `block` with `args` (one pointer per parameter, as
// cuLaunchKernel takes them). `sig` is the caller's idea of the parameters ("p,Q,f,s48"…); a
// mismatch with the kernel's is an error, as is an unknown name, a bad shape or a deadlock.
// `only`/`n_only`: the blocks to run (x, y, z triples), or null for the whole grid.
extern "C" int mw_emu_launch(const char* name, const unsigned grid[3], const unsigned block[3],
                             void** args, const char* sig, char* err, unsigned long errlen,
                             const unsigned* only, unsigned n_only) {
    for (const mw_emu::Entry& e : mw_emu::REGISTRY) {
        if (std::strcmp(e.name, name) != 0) continue;
        std::string want = e.sig();
        if (sig && want != sig) {
            mw_emu::copy_err(std::string(name) + ": the kernel takes (" + want +
                                 ") but was given (" + sig + ")",
                             err, errlen);
            return 1;
        }
        unsigned long threads = (unsigned long)block[0] * block[1] * block[2];
        if (e.bound != 0 && threads > e.bound) {
            // A GPU refuses it (CUDA_ERROR_INVALID_VALUE): the kernel was built for less.
            mw_emu::copy_err(std::string(name) + ": a block of " + std::to_string(threads) +
                                 " threads is over the kernel's __launch_bounds__(" +
                                 std::to_string(e.bound) + ")",
                             err, errlen);
            return 1;
        }
        std::string m;
        if (mw_emu::launch(name, grid, block, e.call, args, want, m, only, n_only) != 0) {
            mw_emu::copy_err(std::string(name) + ": " + m, err, errlen);
            return 1;
        }
        return 0;
    }
    mw_emu::copy_err(std::string("no kernel named ") + name, err, errlen);
    return 1;
}

// Race checks on the calling OS thread's launches: 1 on, 0 off, -1 as MW_EMU_RACES says.
extern "C" void mw_emu_check_races(int on) { mw_emu::g_races = on; }
// Whether this build can check for races (it has the instrumentation's hooks).
extern "C" int mw_emu_races_available() {
#ifdef MW_EMU_RACE_HOOKS
    return 1;
#else
    return 0;
#endif
}

#ifdef MW_EMU_RACE_HOOKS
// The hooks GCC's `-fsanitize=thread` calls before each load and store of the instrumented
// code (every kernel; the emulator's own functions are MW_EMU_UNLOGGED). TSan's runtime is
// not linked: these are the whole of it. Outside a checked launch they return at once.
#define MW_EMU_HOOK(NAME, SIZE, WRITE)                                                            \
    extern "C" MW_EMU_UNLOGGED void NAME(void* p) {                                              \
        if (!mw_emu::g_log) return;                                                               \
        mw_emu::g_log = false;                                                                    \
        mw_emu::log_access(p, SIZE, WRITE);                                                       \
        mw_emu::g_log = true;                                                                     \
    }
#define MW_EMU_HOOKS(N)                                                                           \
    MW_EMU_HOOK(__tsan_read##N, N, false)                                                         \
    MW_EMU_HOOK(__tsan_write##N, N, true)                                                         \
    MW_EMU_HOOK(__tsan_unaligned_read##N, N, false)                                               \
    MW_EMU_HOOK(__tsan_unaligned_write##N, N, true)                                               \
    MW_EMU_HOOK(__tsan_volatile_read##N, N, false)                                                \
    MW_EMU_HOOK(__tsan_volatile_write##N, N, true)
MW_EMU_HOOKS(1)
MW_EMU_HOOKS(2)
MW_EMU_HOOKS(4)
MW_EMU_HOOKS(8)
MW_EMU_HOOKS(16)
#undef MW_EMU_HOOKS
#undef MW_EMU_HOOK
// Aggregate copies (a struct loaded or stored whole).
extern "C" MW_EMU_UNLOGGED void __tsan_read_range(void* p, unsigned long n) {
    if (!mw_emu::g_log) return;
    mw_emu::g_log = false;
    mw_emu::log_access(p, n, false);
    mw_emu::g_log = true;
}
extern "C" MW_EMU_UNLOGGED void __tsan_write_range(void* p, unsigned long n) {
    if (!mw_emu::g_log) return;
    mw_emu::g_log = false;
    mw_emu::log_access(p, n, true);
    mw_emu::g_log = true;
}
// Called by the instrumented module's constructor (TSan's runtime would start here).
extern "C" MW_EMU_UNLOGGED void __tsan_init() {}
extern "C" MW_EMU_UNLOGGED void __tsan_func_entry(void*) {}
extern "C" MW_EMU_UNLOGGED void __tsan_func_exit() {}
#endif

#endif // MW_EMU_RUNTIME_H
