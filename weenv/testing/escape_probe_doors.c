/*
 * weenv escape probe, the other doors (tests/test_escape.py): run as root inside an env, it tries
 * the ways out of issue 16 item 7 and prints one line per attempt, "<attempt>: SUCCEEDED" or
 * "<attempt>: <strerror>" (read with weenv.testing.attempts). Every attempt is harmless when it
 * succeeds (opens without writing, creates and removes at once): the tests run it on the host too,
 * as a control that each attempt can succeed, so a probe broken for its own reasons passes nothing.
 *
 *   doors [--host-file PATH]... [--dev PATH]... [--connect PATH|@ABSTRACT|IP:PORT]... [--sibling PID]
 *         [--dir DIR]
 *       host files directly and through /proc/PID/root; the lowers named in /proc/self/mountinfo;
 *       /proc/sys, /proc/sysrq-trigger and /sys for writing, a cgroup made; mount, fsopen,
 *       open_tree, fspick, umount2, unshare and setns; ptrace, process_vm_readv, pidfd_getfd and
 *       /proc/PID/mem on pid 1 and on --sibling; mknod in DIR and opening --dev nodes; raw
 *       sockets and --connect targets (Unix paths, abstract names, TCP); network interfaces;
 *       CAP_SYS_ADMIN (effective, bounding set); keyctl, bpf, perf_event_open, io_uring_setup,
 *       userfaultfd.
 *   ids
 *       prints "euid N" (a setuid-root copy run by a non-root user shows what the bit grants).
 *   fork MAX
 *       forks children that wait until MAX or a fork fails, prints "forked N: <why it stopped>",
 *       then kills and reaps them all.
 *   mem MIB
 *       allocates and touches MIB MiB, printing "touched N MiB" every 64 MiB.
 *   disk PATH MIB
 *       writes MIB MiB to PATH until an error, prints "wrote N MiB: <result>", removes PATH.
 *   pids KILL_PID...
 *       lists the pids in /proc and sends SIGKILL to each KILL_PID (another env's host pids).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/io_uring.h>
#include <linux/keyctl.h>
#include <linux/perf_event.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_fsopen
#define SYS_fsopen 430
#endif
#ifndef SYS_fspick
#define SYS_fspick 433
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#define CAP_SYS_ADMIN_BIT 21
#define MAX_ARGS 32

static void report(const char *what, int ok, int err) {
    printf("%s: %s\n", what, ok ? "SUCCEEDED" : strerror(err));
    fflush(stdout);
}

static void try_close(const char *what, int fd) {
    report(what, fd >= 0, errno);
    if (fd >= 0) close(fd);
}

/* PATH through /proc/N/root for every N in /proc: SUCCEEDED if any opens. */
static void via_proc_roots(const char *path) {
    char what[512], p[4096];
    int ok = 0, err = ENOENT;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        snprintf(p, sizeof p, "/proc/%s/root%s", e->d_name, path);
        int fd = open(p, O_RDONLY);
        if (fd >= 0) {
            ok = 1;
            close(fd);
        } else if (errno != ENOENT) {
            err = errno;
        }
    }
    if (d) closedir(d);
    snprintf(what, sizeof what, "read %s via /proc/*/root", path);
    report(what, ok, err);
}

static void host_file(const char *path) {
    char what[512];
    snprintf(what, sizeof what, "read %s directly", path);
    try_close(what, open(path, O_RDONLY));
    via_proc_roots(path);
}

/* The lowerdir= paths of the root overlay, as the env's own mountinfo shows them. */
static void lowers(void) {
    FILE *f = fopen("/proc/self/mountinfo", "r");
    char line[16384];
    int tried = 0, ok = 0, err = ENOENT;
    while (f && fgets(line, sizeof line, f)) {
        char *l = strstr(line, "lowerdir=");
        if (!l) continue;
        l += strlen("lowerdir=");
        char *end = l + strcspn(l, ",\n ");
        *end = 0;
        for (char *tok = strtok(l, ":"); tok; tok = strtok(NULL, ":")) {
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", tok, "weenv-escape-probe");
            tried++;
            int fd = open(p, O_CREAT | O_WRONLY, 0600);
            if (fd >= 0) {
                ok = 1;
                close(fd);
                unlink(p);
            } else {
                err = errno;
            }
        }
        break;
    }
    if (f) fclose(f);
    char what[128];
    snprintf(what, sizeof what, "create a file in a lowerdir of the root overlay (%d named)", tried);
    report(what, ok, err);
}

static void for_writing(const char *path) {
    char what[512];
    snprintf(what, sizeof what, "open %s for writing", path);
    try_close(what, open(path, O_WRONLY));
}

static void cgroup_mkdir(void) {
    const char *bases[] = {"/sys/fs/cgroup/pids", "/sys/fs/cgroup/memory", "/sys/fs/cgroup", NULL};
    int ok = 0, err = ENOENT;
    for (int i = 0; bases[i] && !ok; i++) {
        char p[256];
        snprintf(p, sizeof p, "%s/weenv-escape-probe-%d", bases[i], (int)getpid());
        if (mkdir(p, 0755) == 0) {
            ok = 1;
            rmdir(p);
        } else if (errno != ENOENT) {
            err = errno;
        }
    }
    report("make a cgroup under /sys/fs/cgroup", ok, err);
}

static void mounts(const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/weenv-escape-mnt", dir);
    mkdir(p, 0700);
    int r = mount("none", p, "tmpfs", 0, NULL);
    report("mount(tmpfs)", r == 0, errno);
    if (r == 0) umount2(p, MNT_DETACH);
    r = mount("/", p, NULL, MS_BIND, NULL);
    report("mount(bind /)", r == 0, errno);
    if (r == 0) umount2(p, MNT_DETACH);
    rmdir(p);
    try_close("fsopen(tmpfs)", (int)syscall(SYS_fsopen, "tmpfs", 0));
    try_close("open_tree(/, OPEN_TREE_CLONE)", (int)syscall(SYS_open_tree, AT_FDCWD, "/", OPEN_TREE_CLONE));
    try_close("fspick(/)", (int)syscall(SYS_fspick, AT_FDCWD, "/", 0));
    /* umount of a path that is not a mount point: EINVAL if allowed, EPERM if denied */
    r = umount2(dir, 0);
    report("umount2 (EINVAL: allowed, not a mount point)", r == 0, errno);
    int ns = open("/proc/1/ns/mnt", O_RDONLY);
    r = ns >= 0 ? setns(ns, 0) : -1;
    report("setns(/proc/1/ns/mnt)", r == 0, errno);
    if (ns >= 0) close(ns);
}

static void memory_of(pid_t pid, const char *who) {
    char what[256], path[128];
    errno = 0;
    long r = ptrace(PTRACE_ATTACH, pid, 0, 0);
    snprintf(what, sizeof what, "ptrace(PTRACE_ATTACH) %s", who);
    report(what, r == 0, errno);
    if (r == 0) {
        waitpid(pid, NULL, __WALL);
        ptrace(PTRACE_DETACH, pid, 0, 0);
    }
    snprintf(path, sizeof path, "/proc/%d/mem", (int)pid);
    snprintf(what, sizeof what, "open /proc/PID/mem read-write %s", who);
    try_close(what, open(path, O_RDWR));
    char byte;
    struct iovec local = {.iov_base = &byte, .iov_len = 1};
    struct iovec remote = {.iov_base = (void *)0x400000, .iov_len = 1};
    ssize_t w = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    snprintf(what, sizeof what, "process_vm_readv %s", who);
    /* EFAULT means the call was allowed (nothing mapped there): only EPERM/EACCES/ENOSYS deny */
    report(what, w >= 0 || errno == EFAULT, errno);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    int got = -1, err = pidfd < 0 ? errno : EBADF;
    for (int fd = 0; pidfd >= 0 && fd < 16 && got < 0; fd++) {
        got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
        if (got < 0 && errno != EBADF) err = errno;
    }
    snprintf(what, sizeof what, "pidfd_getfd %s", who);
    report(what, got >= 0, err);
    if (got >= 0) close(got);
    if (pidfd >= 0) close(pidfd);
}

static void devices(const char *dir, char **devs, int ndevs) {
    char p[4096];
    snprintf(p, sizeof p, "%s/weenv-escape-kmsg", dir);
    unlink(p);
    int r = mknod(p, S_IFCHR | 0600, makedev(1, 11));
    report("mknod c 1 11 (/dev/kmsg)", r == 0, errno);
    if (r == 0) {
        try_close("open the mknod'ed /dev/kmsg", open(p, O_RDONLY));
        unlink(p);
    }
    for (int i = 0; i < ndevs; i++) {
        char what[512];
        snprintf(what, sizeof what, "open device %s", devs[i]);
        try_close(what, open(devs[i], O_RDONLY));
    }
}

static void connect_to(const char *target) {
    char what[512];
    int s, r;
    if (target[0] == '/' || target[0] == '@') {
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        socklen_t len = sizeof a;
        if (target[0] == '@') {
            a.sun_path[0] = 0;
            strncpy(a.sun_path + 1, target + 1, sizeof a.sun_path - 2);
            len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(target + 1));
        } else {
            strncpy(a.sun_path, target, sizeof a.sun_path - 1);
        }
        s = socket(AF_UNIX, SOCK_STREAM, 0);
        r = connect(s, (struct sockaddr *)&a, len);
    } else {
        char host[64];
        snprintf(host, sizeof host, "%s", target);
        char *colon = strrchr(host, ':');
        struct sockaddr_in a = {.sin_family = AF_INET};
        if (colon) {
            *colon = 0;
            a.sin_port = htons((unsigned short)atoi(colon + 1));
        }
        inet_pton(AF_INET, host, &a.sin_addr);
        s = socket(AF_INET, SOCK_STREAM, 0);
        struct timeval tv = {.tv_sec = 2};
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        r = connect(s, (struct sockaddr *)&a, sizeof a);
    }
    snprintf(what, sizeof what, "connect %s", target);
    report(what, r == 0, errno);
    close(s);
}

static void network(void) {
    try_close("socket(AF_PACKET, SOCK_RAW)", socket(AF_PACKET, SOCK_RAW, htons(0x0003)));
    try_close("socket(AF_INET, SOCK_RAW, ICMP)", socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
    struct if_nameindex *ifs = if_nameindex();
    int others = 0;
    for (struct if_nameindex *i = ifs; i && i->if_index; i++)
        if (strcmp(i->if_name, "lo") != 0) others++;
    if (ifs) if_freenameindex(ifs);
    printf("network interfaces but lo: %d\n", others);
}

static void capabilities(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long eff = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "CapEff: %llx", &eff) == 1) break;
    if (f) fclose(f);
    report("CAP_SYS_ADMIN effective", (eff >> CAP_SYS_ADMIN_BIT) & 1, EPERM);
    int r = prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN_BIT, 0, 0, 0);
    report("CAP_SYS_ADMIN in the bounding set", r == 1, r == 0 ? EPERM : errno);
}

static void kernel_doors(void) {
    long k = syscall(SYS_add_key, "user", "weenv-escape-probe", "x", 1, KEY_SPEC_PROCESS_KEYRING);
    report("add_key (keyctl)", k >= 0, errno);
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.map_type = BPF_MAP_TYPE_ARRAY;
    attr.key_size = 4;
    attr.value_size = 4;
    attr.max_entries = 1;
    try_close("bpf(BPF_MAP_CREATE)", (int)syscall(SYS_bpf, BPF_MAP_CREATE, &attr, sizeof attr));
    struct perf_event_attr pe;
    memset(&pe, 0, sizeof pe);
    pe.type = PERF_TYPE_SOFTWARE;
    pe.size = sizeof pe;
    pe.config = PERF_COUNT_SW_CPU_CLOCK;
    pe.disabled = 1;
    try_close("perf_event_open", (int)syscall(SYS_perf_event_open, &pe, 0, -1, -1, 0));
    struct io_uring_params up;
    memset(&up, 0, sizeof up);
    try_close("io_uring_setup", (int)syscall(SYS_io_uring_setup, 1, &up));
    try_close("userfaultfd", (int)syscall(SYS_userfaultfd, O_CLOEXEC));
}

static int doors(int argc, char **argv) {
    char *files[MAX_ARGS], *devs[MAX_ARGS], *targets[MAX_ARGS];
    int nfiles = 0, ndevs = 0, ntargets = 0;
    pid_t sibling = 0;
    const char *dir = "/tmp";
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--host-file") && nfiles < MAX_ARGS) files[nfiles++] = argv[i + 1];
        else if (!strcmp(argv[i], "--dev") && ndevs < MAX_ARGS) devs[ndevs++] = argv[i + 1];
        else if (!strcmp(argv[i], "--connect") && ntargets < MAX_ARGS) targets[ntargets++] = argv[i + 1];
        else if (!strcmp(argv[i], "--sibling")) sibling = (pid_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir")) dir = argv[i + 1];
        else {
            fprintf(stderr, "doors: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    for (int i = 0; i < nfiles; i++) host_file(files[i]);
    lowers();
    for_writing("/proc/sys/kernel/hostname");
    for_writing("/proc/sys/vm/drop_caches");
    for_writing("/proc/sysrq-trigger");
    for_writing("/sys/kernel/mm/transparent_hugepage/enabled");
    for_writing("/sys/kernel/uevent_helper");
    cgroup_mkdir();
    mounts(dir);
    memory_of(1, "on pid 1");
    if (sibling) memory_of(sibling, "on a sibling");
    devices(dir, devs, ndevs);
    network();
    for (int i = 0; i < ntargets; i++) connect_to(targets[i]);
    capabilities();
    kernel_doors();
    /* last: these change the probe's own namespaces */
    int r = unshare(CLONE_NEWUSER);
    report("unshare(CLONE_NEWUSER)", r == 0, errno);
    r = unshare(CLONE_NEWNS);
    report("unshare(CLONE_NEWNS)", r == 0, errno);
    return 0;
}

static int fork_bomb(int max) {
    pid_t *kids = calloc((size_t)max, sizeof *kids);
    int n = 0, err = 0;
    time_t end = time(NULL) + 10;
    while (n < max && time(NULL) < end) {
        pid_t p = fork();
        if (p == 0) {
            pause();
            _exit(0);
        }
        if (p < 0) {
            err = errno;
            break;
        }
        kids[n++] = p;
    }
    printf("forked %d: %s\n", n, err ? strerror(err) : "reached the bound");
    fflush(stdout);
    for (int i = 0; i < n; i++) kill(kids[i], SIGKILL);
    for (int i = 0; i < n; i++) waitpid(kids[i], NULL, 0);
    return 0;
}

static int mem_bomb(long mib) {
    for (long i = 1; i <= mib; i++) {
        char *p = malloc(1 << 20);
        if (!p) {
            printf("malloc failed at %ld MiB\n", i);
            return 1;
        }
        memset(p, (int)i, 1 << 20);
        if (i % 64 == 0) {
            printf("touched %ld MiB\n", i);
            fflush(stdout);
        }
    }
    printf("touched all %ld MiB\n", mib);
    return 0;
}

static int disk_bomb(const char *path, long mib) {
    static char buf[1 << 20];
    memset(buf, 'x', sizeof buf);
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    if (fd < 0) {
        report("open", 0, errno);
        return 1;
    }
    long n = 0;
    int err = 0;
    for (; n < mib; n++) {
        ssize_t w = write(fd, buf, sizeof buf);
        if (w != (ssize_t)sizeof buf) {
            err = w < 0 ? errno : ENOSPC;
            break;
        }
    }
    if (!err && fsync(fd) != 0) err = errno;
    close(fd);
    unlink(path);
    printf("wrote %ld MiB: %s\n", n, err ? strerror(err) : "SUCCEEDED");
    return 0;
}

static int pids(int argc, char **argv) {
    DIR *d = opendir("/proc");
    struct dirent *e;
    printf("pids in /proc:");
    while (d && (e = readdir(d)) != NULL)
        if (e->d_name[0] >= '0' && e->d_name[0] <= '9') printf(" %s", e->d_name);
    printf("\n");
    if (d) closedir(d);
    for (int i = 2; i < argc; i++) {
        char what[128];
        snprintf(what, sizeof what, "kill(%s, SIGKILL)", argv[i]);
        int r = kill((pid_t)atoi(argv[i]), SIGKILL);
        report(what, r == 0, errno);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "doors")) return doors(argc, argv);
    if (argc == 2 && !strcmp(argv[1], "ids")) return printf("euid %d\n", (int)geteuid()) < 0;
    if (argc == 3 && !strcmp(argv[1], "fork")) return fork_bomb(atoi(argv[2]));
    if (argc == 3 && !strcmp(argv[1], "mem")) return mem_bomb(atol(argv[2]));
    if (argc == 4 && !strcmp(argv[1], "disk")) return disk_bomb(argv[2], atol(argv[3]));
    if (argc >= 2 && !strcmp(argv[1], "pids")) return pids(argc, argv);
    fprintf(stderr, "usage: probe doors [options] | ids | fork MAX | mem MIB | disk PATH MIB | pids PID...\n");
    return 2;
}
