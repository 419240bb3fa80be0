/*
 * delayline: a user-space link between two network namespaces.
 *
 * Creates two TUN devices, A and B, and forwards every packet read from one to
 * the other after a fixed one-way delay, one FIFO per direction.  The devices
 * are created here, in the relay's own namespace, under temporary names; the
 * caller (delayline.py) moves each into its namespace and renames it
 * (ip link set dev TMP netns NS name dl0).  Created this way the devices hold
 * no reference to those namespaces: deleting a namespace deletes its device,
 * and the relay, seeing the error on its descriptor, exits.
 * Optionally it also models the link's serialization (a rate and a drop-tail
 * queue) itself: departure = max(arrival, previous departure) + size/rate,
 * then + delay.  Without --rate-bps the rate is left to a qdisc (tbf) on the
 * TUN devices, which the Python side (delayline.py) sets up.
 *
 * The devices are not persistent: they exist while this process holds them
 * and vanish when it exits.  It exits on a device error, SIGTERM,
 * SIGINT, or EOF on stdin: the parent holds the pipe's other end, so the relay
 * also ends when the parent dies.
 *
 * Protocol: prints "ready rt=0|1" once both devices exist (rt: whether it got
 * SCHED_FIFO); on exit prints one line "stats key=value ..." (packets, bytes,
 * drops, departure - due: mean, extremes, histogram of |error|; CPU time).
 *
 * Timing: CLOCK_MONOTONIC, ppoll(2) with a nanosecond timeout (hrtimer; timer
 * slack 1 ns, none at all under SCHED_FIFO).  No busy spinning.
 *
 * Build: gcc -O2 -Wall -o delayline delayline.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAXPKT (65536 + 64) /* largest read: IP packet (+ vnet header) */
#define HDR 16              /* record header in the ring */
#define ALIGN 64
#define WRAP 0xffffffffu
#define BATCH 8             /* packets read per device before due ones are sent again */
#define NBUCKET 10

static const int64_t bucket_us[NBUCKET - 1] = {5, 10, 20, 50, 100, 200, 500, 1000, 5000};

struct rec {
    uint64_t due;
    uint32_t len;
    uint32_t pad;
};

struct dir {
    const char *name;     /* "a2b" / "b2a" */
    int in, out;          /* read from in, write to out */
    char *buf;            /* ring of records */
    size_t cap, head, tail, count;
    uint64_t next_free;   /* rate model: when the link is free again */
    uint64_t pkts, bytes, drops_queue, write_err, write_again;
    uint64_t late_max, early_max, early, hist[NBUCKET]; /* error = departure - due */
    int64_t err_sum;
};

static volatile sig_atomic_t stop_flag;

/* Early wake-up: a timer sleep overshoots by some tens of microseconds here (a VM's timer
 * and wake-up path).  The relay sleeps until due - wake_adv, wake_adv being the median
 * overshoot of its recent timed sleeps, and sends what is due within wake_adv, so departures
 * scatter around the due time instead of all coming late. */
#define NSAMPLE 63
#define ADV_MAX 200000
static int64_t wake_adv, samples[NSAMPLE];
static int nsample, adaptive = 1;

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void wake_sample(int64_t overshoot)
{
    samples[nsample++] = overshoot;
    if (nsample < NSAMPLE)
        return;
    qsort(samples, NSAMPLE, sizeof samples[0], cmp_i64);
    int64_t m = samples[NSAMPLE / 2];
    wake_adv = m < 0 ? 0 : m > ADV_MAX ? ADV_MAX : m;
    nsample = 0;
}

static void on_signal(int sig) { (void)sig; stop_flag = 1; }

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what)
{
    fprintf(stderr, "delayline: %s: %s\n", what, strerror(errno));
    exit(1);
}

static size_t rec_size(size_t len) { return (HDR + len + ALIGN - 1) & ~(size_t)(ALIGN - 1); }

/* Where the next record may be written (room for MAXPKT), or NULL if full. */
static char *ring_slot(struct dir *d)
{
    size_t need = rec_size(MAXPKT);
    if (d->count == 0)
        d->head = d->tail = 0;
    if (d->count == 0 || d->head > d->tail) {
        if (d->cap - d->head >= need)
            return d->buf + d->head;
        if (d->tail > need) { /* wrap: mark the rest of the buffer unused */
            if (d->cap - d->head >= HDR)
                ((struct rec *)(d->buf + d->head))->len = WRAP;
            d->head = 0;
            return d->buf;
        }
        return NULL;
    }
    if (d->head < d->tail && d->tail - d->head > need)
        return d->buf + d->head;
    return NULL;
}

static struct rec *ring_front(struct dir *d)
{
    if (d->count == 0)
        return NULL;
    if (d->cap - d->tail < HDR || ((struct rec *)(d->buf + d->tail))->len == WRAP)
        d->tail = 0;
    return (struct rec *)(d->buf + d->tail);
}

static void ring_pop(struct dir *d, struct rec *r)
{
    d->tail += rec_size(r->len);
    if (--d->count == 0)
        d->head = d->tail = 0;
}

static int open_tun(const char *ifname, int vnet)
{
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        die("/dev/net/tun");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | (vnet ? IFF_VNET_HDR : 0);
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", ifname);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0)
        die("TUNSETIFF");
    if (vnet) {
        /* The virtio header passes through unchanged, as between two virtio
         * guests: checksums stay partial (no pass over each packet on either
         * side) and TCP hands over 64 KiB TSO packets whatever the MTU. */
        if (ioctl(fd, TUNSETOFFLOAD, (unsigned long)(TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)) < 0)
            die("TUNSETOFFLOAD");
    }
    return fd;
}

/* Read what is waiting on d->in, stamp it, queue it. */
static void take(struct dir *d, uint64_t delay, uint64_t rate, uint64_t queue_ns)
{
    for (int i = 0; i < BATCH; i++) {
        char *slot = ring_slot(d);
        if (!slot)
            return; /* full: leave packets in the TUN queue (it drops) */
        ssize_t n = read(d->in, slot + HDR, MAXPKT);
        if (n <= 0) {
            if (n < 0 && errno != EAGAIN && errno != EINTR)
                die("read");
            return;
        }
        uint64_t t = now_ns(), due = t + delay;
        if (rate) {
            uint64_t start = d->next_free > t ? d->next_free : t;
            if (start - t > queue_ns) {
                d->drops_queue++;
                continue;
            }
            d->next_free = start + ((uint64_t)n * 8000000000ull + rate - 1) / rate;
            due = d->next_free + delay;
        }
        struct rec *r = (struct rec *)slot;
        r->due = due;
        r->len = (uint32_t)n;
        d->head = (size_t)(slot - d->buf) + rec_size((size_t)n);
        d->count++;
    }
}

/* Write every packet that is due; return the next due time (or 0). */
static uint64_t give(struct dir *d)
{
    struct rec *r;
    while ((r = ring_front(d))) {
        uint64_t t = now_ns();
        if (r->due > t + (uint64_t)wake_adv)
            return r->due;
        ssize_t n = write(d->out, (char *)r + HDR, r->len);
        if (n < 0 && errno == EAGAIN) {
            d->write_again++;
            return t + 20000; /* retry in 20 us */
        }
        if (n < 0)
            d->write_err++;
        int64_t err = (int64_t)(t - r->due), mag = err < 0 ? -err : err;
        int b = 0;
        while (b < NBUCKET - 1 && mag >= bucket_us[b] * 1000)
            b++;
        d->hist[b]++;
        d->err_sum += err;
        if (err < 0) {
            d->early++;
            if ((uint64_t)mag > d->early_max)
                d->early_max = (uint64_t)mag;
        } else if ((uint64_t)err > d->late_max) {
            d->late_max = (uint64_t)err;
        }
        d->pkts++;
        d->bytes += r->len;
        ring_pop(d, r);
    }
    return 0;
}

static void print_stats(struct dir *dirs, uint64_t t0)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("stats wall_ns=%llu wake_adv_ns=%lld cpu_user_ns=%llu cpu_sys_ns=%llu",
           (unsigned long long)(now_ns() - t0), (long long)wake_adv,
           (unsigned long long)ru.ru_utime.tv_sec * 1000000000ull + (unsigned long long)ru.ru_utime.tv_usec * 1000ull,
           (unsigned long long)ru.ru_stime.tv_sec * 1000000000ull + (unsigned long long)ru.ru_stime.tv_usec * 1000ull);
    for (int i = 0; i < 2; i++) {
        struct dir *d = &dirs[i];
        printf(" %s_pkts=%llu %s_bytes=%llu %s_drops_queue=%llu %s_write_err=%llu %s_write_again=%llu"
               " %s_late_max_ns=%llu %s_early_max_ns=%llu %s_early=%llu %s_err_sum_ns=%lld %s_err_hist=",
               d->name, (unsigned long long)d->pkts, d->name, (unsigned long long)d->bytes, d->name,
               (unsigned long long)d->drops_queue, d->name, (unsigned long long)d->write_err, d->name,
               (unsigned long long)d->write_again, d->name, (unsigned long long)d->late_max, d->name,
               (unsigned long long)d->early_max, d->name, (unsigned long long)d->early, d->name,
               (long long)d->err_sum, d->name);
        for (int b = 0; b < NBUCKET; b++)
            printf("%s%llu", b ? "," : "", (unsigned long long)d->hist[b]);
    }
    printf("\n");
    fflush(stdout);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: delayline --dev-a NAME --dev-b NAME --delay-ns N [--rate-bps R --queue-ns Q]\n"
            "                 [--ring-bytes B] [--priority P] [--vnet-hdr] [--no-early-wake]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    const char *dev_a = NULL, *dev_b = NULL;
    uint64_t delay = 0, rate = 0, queue_ns = 5000000, ring_bytes = 32u << 20;
    int prio = 50, vnet = 0;
    static const struct option opts[] = {
        {"dev-a", required_argument, 0, 'a'},      {"dev-b", required_argument, 0, 'b'},
        {"delay-ns", required_argument, 0, 'd'},
        {"rate-bps", required_argument, 0, 'r'},   {"queue-ns", required_argument, 0, 'q'},
        {"ring-bytes", required_argument, 0, 's'}, {"priority", required_argument, 0, 'p'},
        {"vnet-hdr", no_argument, 0, 'v'},         {"no-early-wake", no_argument, 0, 'e'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'a': dev_a = optarg; break;
        case 'b': dev_b = optarg; break;
        case 'd': delay = strtoull(optarg, NULL, 10); break;
        case 'r': rate = strtoull(optarg, NULL, 10); break;
        case 'q': queue_ns = strtoull(optarg, NULL, 10); break;
        case 's': ring_bytes = strtoull(optarg, NULL, 10); break;
        case 'p': prio = atoi(optarg); break;
        case 'v': vnet = 1; break;
        case 'e': adaptive = 0; break;
        default: usage();
        }
    }
    if (!dev_a || !dev_b || optind != argc)
        usage();
    if (ring_bytes < 4 * (uint64_t)rec_size(MAXPKT))
        ring_bytes = 4 * (uint64_t)rec_size(MAXPKT);

    prctl(PR_SET_TIMERSLACK, 1UL);

    int fa = open_tun(dev_a, vnet);
    int fb = open_tun(dev_b, vnet);

    struct dir dirs[2];
    memset(dirs, 0, sizeof dirs);
    dirs[0].name = "a2b", dirs[0].in = fa, dirs[0].out = fb;
    dirs[1].name = "b2a", dirs[1].in = fb, dirs[1].out = fa;
    for (int i = 0; i < 2; i++) {
        dirs[i].cap = ring_bytes;
        dirs[i].buf = mmap(NULL, ring_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (dirs[i].buf == MAP_FAILED)
            die("mmap");
    }

    struct sched_param sp = {.sched_priority = prio};
    int rt = prio > 0 && sched_setscheduler(0, SCHED_FIFO, &sp) == 0;

    sigset_t block, orig;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &orig);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    printf("ready rt=%d\n", rt);
    fflush(stdout);

    uint64_t t0 = now_ns();
    while (!stop_flag) {
        uint64_t next = 0;
        for (int i = 0; i < 2; i++) {
            uint64_t n = give(&dirs[i]);
            if (n && (!next || n < next))
                next = n;
        }
        struct pollfd pf[3] = {
            {.fd = fa, .events = ring_slot(&dirs[0]) ? POLLIN : 0},
            {.fd = fb, .events = ring_slot(&dirs[1]) ? POLLIN : 0},
            {.fd = 0, .events = POLLIN},
        };
        struct timespec ts, *tp = NULL;
        uint64_t wake_at = 0;
        if (next) {
            wake_at = next - (uint64_t)wake_adv;
            uint64_t t = now_ns(), w = wake_at > t ? wake_at - t : 0;
            if (!w)
                wake_at = 0; /* not a sleep: no sample */
            ts.tv_sec = (time_t)(w / 1000000000ull);
            ts.tv_nsec = (long)(w % 1000000000ull);
            tp = &ts;
        }
        int n = ppoll(pf, 3, tp, &orig);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("ppoll");
        }
        if (n == 0 && wake_at && adaptive)
            wake_sample((int64_t)(now_ns() - wake_at));
        if (pf[2].revents) { /* parent closed our stdin (or it is gone) */
            char junk[256];
            if (!(pf[2].revents & POLLIN) || read(0, junk, sizeof junk) <= 0)
                break;
        }
        for (int i = 0; i < 2; i++) {
            if (pf[i].revents & POLLIN)
                take(&dirs[i], delay, rate, queue_ns);
            if (pf[i].revents & (POLLERR | POLLHUP | POLLNVAL)) {
                fprintf(stderr, "delayline: device %c (%s) is gone: its namespace deleted?\n",
                        i ? 'B' : 'A', i ? dev_b : dev_a);
                stop_flag = 1;
            }
        }
    }
    print_stats(dirs, t0);
    return 0;
}
