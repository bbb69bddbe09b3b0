/*
 * weenv-agent: pid 1 of a weenv env. It reaps orphans (as catatonit -P would) and runs commands
 * for the weenv daemon, which connects to a Unix socket in a directory only root can enter.
 * A command started here is a child of the env's init: it is born in the env's namespaces and
 * cgroups, under its seccomp filter, capability bounding set and no_new_privileges, exactly like
 * the init itself. This replaces `crun exec` (a fork of crun, state parsing and setns into every
 * namespace, ~12-20 ms) with a fork+exec in the env (~1 ms).
 *
 * usage: weenv-agent --fd N [--key-first]
 *                                accept on an inherited listening socket (what weenv does: the
 *                                socket is bound by the daemon outside the env, so nothing in the
 *                                env can replace it with a link to some other socket)
 *        weenv-agent SOCKET_PATH  bind a socket at SOCKET_PATH (for tests and other runtimes)
 *
 * Nothing in the env may answer in the agent's place (docs/security.md): the agent makes itself
 * undumpable before anything else runs in the env, so env root (same uid, no CAP_SYS_PTRACE) cannot
 * ptrace it, open /proc/1/mem or /proc/1/fd, or pidfd_getfd(2) its listening socket. With
 * --key-first the first connection waiting on the socket is the daemon's and carries the env's key
 * ('K' frame); the agent keeps it in memory only and starts every later connection with an 'H'
 * frame holding it, so the daemon can tell its agent from anything else listening. Signals that
 * would stop the agent are only obeyed when they come from outside the env's pid namespace.
 *
 * The agent keeps the table of the processes it started (the process handles of docs/architecture.md,
 * "Processes"): the table, and the output of background processes that nobody was reading, live
 * here, so they outlive the client that started them and the daemon too.
 *
 * Protocol: frames are [type:1][length:4, big endian][payload]. A connection's first frame says
 * what it is for:
 *   agent -> daemon  'H' hello (payload: the env's key), first on every connection when keyed
 *   daemon -> agent  'R' start a command: NUL-terminated key/value strings, keys: arg (repeated, argv),
 *                        env (repeated, NAME=VALUE), cwd, uid, gid, group (repeated), stdin ("1": frames
 *                        follow), background ("1": the command outlives this connection), pty ("1": on
 *                        a pseudo-terminal, size rows x cols), rows, cols, tag (a label for 'L'),
 *                        buffer (bytes of output kept while nobody reads, background only),
 *                        shown_env (repeated NAME=VALUE: what 'L' shows as the command's env)
 *                    'A' attach to a running or finished command: keys pid, output ("1": send its
 *                        output, first what was kept while nobody read; "0": control only)
 *                    'L' list the commands (one 'L' frame each, then the agent closes)
 *   then, on an 'R' or 'A' connection:
 *   daemon -> agent  'I' stdin bytes      'E' end of stdin (on a pty: ^D)   'K' signal (payload: number)
 *                    'W' pty size (payload: "rows cols")
 *                    (on an 'A' connection without output each of these is answered 'Y' "1" done, "0" not:
 *                    stdin closed or never opened, no pty, the command already exited)
 *   agent -> daemon  'P' started / attached (pid)   'O' stdout bytes   'e' stderr bytes   'T' pty bytes
 *                    'D' bytes of output dropped while nobody read (payload: count, before the rest)
 *                    'F' could not start (payload: "errno*10+stage message"; stage 4: no such pid)
 *                    'X' finished (payload: exit code, 128+N for signal N, then " N" when signal N ended it)
 *                    'L' one command: key/value strings pid, tag, pty, background, stdin, state
 *                        (running | exited), code, signal, buffered, dropped, arg (repeated), cwd,
 *                        env (repeated)
 * Closing a one-shot command's 'R' connection while it runs kills the command's whole session; a
 * background command runs on, and its output is kept (the newest `buffer` bytes, whole frames) until
 * an 'A' connection reads it. The last MAX_KEPT finished background commands stay listed.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define MAX_CONNS 256
#define MAX_PROCS 256
#define MAX_KEPT 64                 /* finished background commands kept for wait / attach / list */
#define MAX_REQUEST (4u << 20)
#define MAX_ARGS 4096
#define MAX_GROUPS 256
#define MAX_INFO (16u << 10)        /* what 'L' shows of argv and cwd */
#define DEFAULT_BUFFER (1u << 20)
#define MAX_BUFFER (16u << 20)
#define MAX_PENDING_IN (4u << 20)   /* stdin not yet taken by the command: stop reading frames beyond */
#define DRAIN_GRACE_NS 100000000LL /* wait this long for pipes to close after the command exits */
#define MAX_QUEUE (MAX_BUFFER + (1u << 20)) /* a reader this far behind is cut off (it may attach again) */

enum { ROLE_NEW, ROLE_OWNER, ROLE_READER, ROLE_CONTROL };

struct conn {
    int fd;
    int used;
    /* reading a frame */
    unsigned char hdr[5];
    size_t hdr_got;
    unsigned char *body;
    uint32_t body_len;
    size_t body_got;
    int role; /* ROLE_OWNER: a one-shot command dies with this connection */
    int proc; /* index in procs, -1 */
    /* a reader's frames not yet sent: the agent never waits for a slow reader */
    unsigned char *out;
    size_t out_off, out_len;
    int closing; /* close once out is sent */
};

struct proc {
    int used;
    pid_t pid;
    int in_fd, out_fd, err_fd; /* on a pty out_fd is the master and in_fd a duplicate of it */
    int pty, background, has_stdin;
    int pty_hup; /* the terminal's last fd closed: the master is kept (not polled) until the command is reaped */
    int exited;      /* reaped */
    int ended;       /* output drained, 'X' sent: only the record is left */
    int status;
    long long exited_at;
    unsigned long long seq;
    unsigned char *pending_in; /* stdin bytes not yet written */
    size_t pending_len;
    int stdin_eof;
    unsigned char *kept; /* frames nobody read (background), oldest first from kept_off */
    size_t kept_off, kept_len, kept_cap;
    unsigned long long dropped;
    char *info; /* key/value strings for 'L': tag, arg..., cwd */
    uint32_t info_len;
};

static struct conn conns[MAX_CONNS];
static struct proc procs[MAX_PROCS];
static unsigned long long next_seq;

#define MAX_KEY 64
#define KEY_WAIT_MS 10000
static unsigned char key[MAX_KEY];
static uint32_t key_len; /* 0: not keyed (no hello frame) */

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int send_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void put_hdr(unsigned char *hdr, char type, uint32_t len) {
    hdr[0] = (unsigned char)type;
    hdr[1] = (unsigned char)(len >> 24), hdr[2] = (unsigned char)(len >> 16);
    hdr[3] = (unsigned char)(len >> 8), hdr[4] = (unsigned char)len;
}

static int send_frame(int fd, char type, const void *data, uint32_t len) {
    unsigned char hdr[5];
    put_hdr(hdr, type, len);
    if (send_all(fd, hdr, 5) < 0) return -1;
    return len ? send_all(fd, data, len) : 0;
}

static int send_text(int fd, char type, const char *fmt, long long a, const char *s) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, fmt, a, s ? s : "");
    if (n < 0) n = 0;
    if (n >= (int)sizeof buf) n = sizeof buf - 1;
    return send_frame(fd, type, buf, (uint32_t)n);
}

static void close_fd(int *fd) {
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* SIGKILL every process in the command's session (setsid made its pid the session id). */
static void kill_session(pid_t sid, int sig) {
    if (sid <= 0) return;
    kill(-sid, sig);
    DIR *d = opendir("/proc");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 1) continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0) continue;
        buf[n] = 0;
        char *p = strrchr(buf, ')');
        if (!p) continue;
        char state;
        long ppid, pgrp, session;
        if (sscanf(p + 2, "%c %ld %ld %ld", &state, &ppid, &pgrp, &session) != 4) continue;
        if (session == sid) kill((pid_t)pid, sig);
    }
    closedir(d);
}

static void free_proc(struct proc *p) {
    close_fd(&p->in_fd);
    close_fd(&p->out_fd);
    close_fd(&p->err_fd);
    free(p->pending_in);
    free(p->kept);
    free(p->info);
    memset(p, 0, sizeof *p);
    p->in_fd = p->out_fd = p->err_fd = -1;
}

static void finish(struct conn *c) {
    if (!c->used) return;
    if (c->role == ROLE_OWNER && c->proc >= 0) {
        struct proc *p = &procs[c->proc];
        if (p->used && p->pid > 0 && !p->exited) kill_session(p->pid, SIGKILL);
    }
    close_fd(&c->fd);
    free(c->body);
    free(c->out);
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->proc = -1;
}

/* Send what a reader's queue holds, as far as its socket takes it without waiting. */
static void flush(struct conn *c) {
    while (c->out_len > 0) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN) finish(c);
            return;
        }
        c->out_off += (size_t)n;
        c->out_len -= (size_t)n;
    }
    c->out_off = 0;
    if (c->closing) finish(c);
}

static int queue_bytes(struct conn *c, const unsigned char *data, size_t len) {
    if (c->out_len + len > MAX_QUEUE) return -1;
    if (c->out_off + c->out_len + len > MAX_QUEUE || c->out == NULL) {
        if (c->out_off) memmove(c->out, c->out + c->out_off, c->out_len), c->out_off = 0;
        if (c->out == NULL && !(c->out = malloc(MAX_QUEUE))) return -1;
    }
    memcpy(c->out + c->out_off + c->out_len, data, len);
    c->out_len += len;
    return 0;
}

/* A frame for a reader: queued, then sent as far as it goes; a reader too far behind is cut off. */
static void queue_frame(struct conn *c, char type, const void *data, uint32_t len) {
    unsigned char hdr[5];
    put_hdr(hdr, type, len);
    if (queue_bytes(c, hdr, 5) < 0 || queue_bytes(c, data, len) < 0) {
        finish(c);
        return;
    }
    flush(c);
}

/* The reader's last frame: it goes once the queue is sent; the connection no longer follows the process. */
static void queue_last(struct conn *c, char type, const void *data, uint32_t len) {
    c->proc = -1;
    c->closing = 1;
    queue_frame(c, type, data, len);
}

static int attached(int pi, int readers_only) {
    int n = 0;
    for (int i = 0; i < MAX_CONNS; i++)
        if (conns[i].used && conns[i].proc == pi &&
            (conns[i].role == ROLE_OWNER || conns[i].role == ROLE_READER || (!readers_only && conns[i].role == ROLE_CONTROL)))
            n++;
    return n;
}

/* Keep one frame of output for a later reader: the newest kept_cap bytes, whole frames. */
static void keep_frame(struct proc *p, char type, const unsigned char *data, uint32_t len) {
    size_t need = 5 + (size_t)len;
    if (need > p->kept_cap) { /* one frame larger than the whole buffer: keep its tail */
        p->dropped += len - (p->kept_cap - 5);
        data += len - (p->kept_cap - 5);
        len = (uint32_t)(p->kept_cap - 5);
        need = p->kept_cap;
    }
    while (p->kept_len + need > p->kept_cap) { /* drop the oldest frames */
        unsigned char *h = p->kept + p->kept_off;
        uint32_t n = ((uint32_t)h[1] << 24) | ((uint32_t)h[2] << 16) | ((uint32_t)h[3] << 8) | h[4];
        p->dropped += n;
        p->kept_off += 5 + n;
        p->kept_len -= 5 + n;
    }
    if (p->kept == NULL) {
        p->kept = malloc(p->kept_cap);
        if (!p->kept) { p->dropped += len; return; }
    }
    if (p->kept_off + p->kept_len + need > p->kept_cap) { /* compact */
        memmove(p->kept, p->kept + p->kept_off, p->kept_len);
        p->kept_off = 0;
    }
    unsigned char *dst = p->kept + p->kept_off + p->kept_len;
    put_hdr(dst, type, len);
    memcpy(dst + 5, data, len);
    p->kept_len += need;
}

/* Output of procs[pi] to everyone reading it; kept for later when nobody is (background only). */
static void deliver(int pi, char type, const unsigned char *data, uint32_t len) {
    struct proc *p = &procs[pi];
    int sent = 0;
    for (int i = 0; i < MAX_CONNS; i++) {
        struct conn *c = &conns[i];
        if (!c->used || c->proc != pi || (c->role != ROLE_OWNER && c->role != ROLE_READER)) continue;
        if (c->role == ROLE_READER) {
            queue_frame(c, type, data, len);
            sent += c->used;
        } else if (send_frame(c->fd, type, data, len) < 0) {
            finish(c);
        } else {
            sent++;
        }
    }
    if (!sent && p->background) keep_frame(p, type, data, len);
}

static void exit_text(struct proc *p, char *buf, size_t size) {
    if (WIFEXITED(p->status)) snprintf(buf, size, "%d", WEXITSTATUS(p->status));
    else if (WIFSIGNALED(p->status)) snprintf(buf, size, "%d %d", 128 + WTERMSIG(p->status), WTERMSIG(p->status));
    else snprintf(buf, size, "255");
}

/* The command exited and its output is drained (or the grace is over): tell everyone attached. */
static void end_proc(int pi) {
    struct proc *p = &procs[pi];
    char text[32];
    exit_text(p, text, sizeof text);
    for (int i = 0; i < MAX_CONNS; i++) {
        struct conn *c = &conns[i];
        if (!c->used || c->proc != pi) continue;
        if (c->role == ROLE_READER) {
            queue_last(c, 'X', text, (uint32_t)strlen(text));
            continue;
        }
        send_frame(c->fd, 'X', text, (uint32_t)strlen(text));
        finish(c);
    }
    if (!p->background) {
        free_proc(p);
        return;
    }
    p->ended = 1;
    close_fd(&p->in_fd);
    close_fd(&p->out_fd);
    close_fd(&p->err_fd);
    free(p->pending_in);
    p->pending_in = NULL;
    p->pending_len = 0;
    /* only the newest MAX_KEPT finished records stay */
    int kept = 0;
    for (int i = 0; i < MAX_PROCS; i++) kept += procs[i].used && procs[i].ended;
    while (kept > MAX_KEPT) {
        int oldest = -1;
        for (int i = 0; i < MAX_PROCS; i++)
            if (procs[i].used && procs[i].ended && !attached(i, 0) && (oldest < 0 || procs[i].seq < procs[oldest].seq)) oldest = i;
        if (oldest < 0) break;
        free_proc(&procs[oldest]);
        kept--;
    }
}

static int find_proc(pid_t pid) {
    int found = -1;
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i].used && procs[i].pid == pid && (found < 0 || !procs[i].ended)) found = i;
    return found;
}

static int new_proc_slot(void) {
    int oldest = -1;
    for (int i = 0; i < MAX_PROCS; i++) {
        if (!procs[i].used) return i;
        if (procs[i].ended && !attached(i, 0) && (oldest < 0 || procs[i].seq < procs[oldest].seq)) oldest = i;
    }
    if (oldest >= 0) free_proc(&procs[oldest]);
    return oldest;
}

static void info_add(char *info, uint32_t *len, const char *k, const char *v) {
    size_t kl = strlen(k) + 1, vl = strlen(v) + 1;
    if (*len + kl + vl > MAX_INFO) return;
    memcpy(info + *len, k, kl);
    memcpy(info + *len + kl, v, vl);
    *len += (uint32_t)(kl + vl);
}

static int start_command(struct conn *c, unsigned char *req, uint32_t len) {
    char *argv[MAX_ARGS + 1];
    char *envp[MAX_ARGS + 1];
    char *shown[MAX_ARGS];
    gid_t groups[MAX_GROUPS];
    int argc = 0, envc = 0, nshown = 0, ngroups = 0, want_stdin = 0, background = 0, pty = 0;
    char *cwd = NULL, *tag = NULL;
    long uid = 0, gid = 0, rows = 24, cols = 80, buffer = DEFAULT_BUFFER;
    char *p = (char *)req, *end = (char *)req + len;
    if (len == 0 || req[len - 1] != 0) {
        send_text(c->fd, 'F', "%lld %s", EINVAL, "malformed request");
        return -1;
    }
    while (p < end) {
        char *key = p;
        p += strlen(p) + 1;
        if (p >= end) break;
        char *val = p;
        p += strlen(p) + 1;
        if (!strcmp(key, "arg") && argc < MAX_ARGS) argv[argc++] = val;
        else if (!strcmp(key, "env") && envc < MAX_ARGS) envp[envc++] = val;
        else if (!strcmp(key, "cwd")) cwd = val;
        else if (!strcmp(key, "uid")) uid = strtol(val, NULL, 10);
        else if (!strcmp(key, "gid")) gid = strtol(val, NULL, 10);
        else if (!strcmp(key, "group") && ngroups < MAX_GROUPS) groups[ngroups++] = (gid_t)strtol(val, NULL, 10);
        else if (!strcmp(key, "stdin")) want_stdin = val[0] == '1';
        else if (!strcmp(key, "background")) background = val[0] == '1';
        else if (!strcmp(key, "pty")) pty = val[0] == '1';
        else if (!strcmp(key, "rows")) rows = strtol(val, NULL, 10);
        else if (!strcmp(key, "cols")) cols = strtol(val, NULL, 10);
        else if (!strcmp(key, "tag")) tag = val;
        else if (!strcmp(key, "shown_env") && nshown < MAX_ARGS) shown[nshown++] = val;
        else if (!strcmp(key, "buffer")) buffer = strtol(val, NULL, 10);
    }
    argv[argc] = NULL;
    envp[envc] = NULL;
    if (argc == 0) {
        send_text(c->fd, 'F', "%lld %s", EINVAL, "empty argv");
        return -1;
    }
    if (rows < 1 || rows > 65535 || cols < 1 || cols > 65535) rows = 24, cols = 80;
    if (buffer < 4096) buffer = 4096;
    if (buffer > (long)MAX_BUFFER) buffer = MAX_BUFFER;
    int pi = new_proc_slot();
    if (pi < 0) {
        send_text(c->fd, 'F', "%lld %s", (long long)EAGAIN * 10, "too many processes");
        return -1;
    }
    int in_p[2] = {-1, -1}, out_p[2] = {-1, -1}, err_p[2] = {-1, -1}, st_p[2] = {-1, -1};
    int master = -1, slave = -1;
    if (pty) {
        struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
        if (openpty(&master, &slave, NULL, NULL, &ws) < 0) goto fail;
        fcntl(master, F_SETFD, FD_CLOEXEC);
        fcntl(slave, F_SETFD, FD_CLOEXEC);
        if (fchown(slave, (uid_t)uid, (gid_t)-1) < 0) { /* the command's own terminal, as login(1) does */ }
        want_stdin = 1;
    } else {
        if (want_stdin ? pipe2(in_p, O_CLOEXEC) : 0) goto fail;
        if (pipe2(out_p, O_CLOEXEC) || pipe2(err_p, O_CLOEXEC)) goto fail;
    }
    if (pipe2(st_p, O_CLOEXEC)) goto fail;
    pid_t pid = fork();
    if (pid < 0) goto fail;
    if (pid == 0) {
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
        setsid();
        if (pty) {
            ioctl(slave, TIOCSCTTY, 0);
            dup2(slave, 0);
            dup2(slave, 1);
            dup2(slave, 2);
        } else {
            int null_fd = open("/dev/null", O_RDONLY);
            dup2(want_stdin ? in_p[0] : (null_fd >= 0 ? null_fd : 0), 0);
            dup2(out_p[1], 1);
            dup2(err_p[1], 2);
        }
        int report[2] = {0, 0}; /* stage (1 identity, 2 cwd, 3 exec), errno */
        if (setgroups((size_t)ngroups, groups) < 0 || setgid((gid_t)gid) < 0 || setuid((uid_t)uid) < 0)
            report[0] = 1, report[1] = errno;
        else if (cwd && chdir(cwd) < 0)
            report[0] = 2, report[1] = errno;
        else {
            environ = envp; /* execvp searches the PATH of the command's own environment */
            execvp(argv[0], argv);
            report[0] = 3, report[1] = errno;
        }
        ssize_t unused = write(st_p[1], report, sizeof report);
        (void)unused;
        _exit(report[0] == 3 && (report[1] == ENOENT || report[1] == ENOTDIR) ? 127 : 126);
    }
    close_fd(&st_p[1]);
    close_fd(&out_p[1]);
    close_fd(&err_p[1]);
    close_fd(&in_p[0]);
    close_fd(&slave);
    int report[2] = {0, 0};
    ssize_t n;
    do n = read(st_p[0], report, sizeof report); while (n < 0 && errno == EINTR);
    close(st_p[0]);
    /* a finished record of a pid the kernel has now given again is forgotten */
    for (int old; (old = find_proc(pid)) >= 0 && procs[old].ended;) free_proc(&procs[old]);
    struct proc *pr = &procs[pi];
    memset(pr, 0, sizeof *pr);
    pr->used = 1;
    pr->pid = pid;
    pr->seq = ++next_seq;
    pr->pty = pty;
    pr->has_stdin = want_stdin;
    pr->background = background && n != (ssize_t)sizeof report; /* a command that never ran leaves no record */
    pr->kept_cap = (size_t)buffer;
    pr->err_fd = -1;
    if (pty) {
        pr->out_fd = master;
        pr->in_fd = dup(master);
        if (pr->in_fd >= 0) fcntl(pr->in_fd, F_SETFD, FD_CLOEXEC);
    } else {
        pr->out_fd = out_p[0];
        pr->err_fd = err_p[0];
        pr->in_fd = in_p[1];
    }
    pr->stdin_eof = !want_stdin;
    if (pr->in_fd >= 0) fcntl(pr->in_fd, F_SETFL, O_NONBLOCK);
    pr->info = malloc(MAX_INFO);
    if (pr->info) {
        if (tag) info_add(pr->info, &pr->info_len, "tag", tag);
        for (int i = 0; i < argc; i++) info_add(pr->info, &pr->info_len, "arg", argv[i]);
        if (cwd) info_add(pr->info, &pr->info_len, "cwd", cwd);
        for (int i = 0; i < nshown; i++) info_add(pr->info, &pr->info_len, "env", shown[i]);
    }
    c->proc = pi;
    c->role = pr->background ? ROLE_READER : ROLE_OWNER;
    if (n == (ssize_t)sizeof report) {
        char what[64];
        snprintf(what, sizeof what, "%s", report[0] == 1 ? "identity" : report[0] == 2 ? "cwd" : "exec");
        send_text(c->fd, 'F', "%lld %s", (long long)report[1] * 10 + report[0], what);
    } else {
        send_text(c->fd, 'P', "%lld%s", pid, NULL);
    }
    return 0;
fail:
    send_text(c->fd, 'F', "%lld %s", (long long)errno * 10, pty ? "cannot open a pty or fork" : "cannot create pipes or fork");
    for (int *fd = in_p; fd < in_p + 2; fd++) close_fd(fd);
    for (int *fd = out_p; fd < out_p + 2; fd++) close_fd(fd);
    for (int *fd = err_p; fd < err_p + 2; fd++) close_fd(fd);
    for (int *fd = st_p; fd < st_p + 2; fd++) close_fd(fd);
    close_fd(&master);
    close_fd(&slave);
    return -1;
}

static const char *kv_get(unsigned char *body, uint32_t len, const char *want) {
    char *p = (char *)body, *end = (char *)body + len;
    if (len == 0 || body[len - 1] != 0) return NULL;
    while (p < end) {
        char *k = p;
        p += strlen(p) + 1;
        if (p >= end) return NULL;
        if (!strcmp(k, want)) return p;
        p += strlen(p) + 1;
    }
    return NULL;
}

static void attach(struct conn *c, unsigned char *body, uint32_t len) {
    const char *pid_s = kv_get(body, len, "pid"), *out_s = kv_get(body, len, "output");
    int pi = pid_s ? find_proc((pid_t)strtol(pid_s, NULL, 10)) : -1;
    if (pi < 0 || !pid_s || strtol(pid_s, NULL, 10) <= 0) {
        send_text(c->fd, 'F', "%lld %s", (long long)ESRCH * 10 + 4, "no such process");
        finish(c);
        return;
    }
    struct proc *p = &procs[pi];
    c->proc = pi;
    c->role = out_s && out_s[0] == '1' ? ROLE_READER : ROLE_CONTROL;
    if (send_text(c->fd, 'P', "%lld%s", p->pid, NULL) < 0) { finish(c); return; }
    if (c->role == ROLE_READER) {
        if (p->dropped) {
            char n[32];
            snprintf(n, sizeof n, "%llu", p->dropped);
            if (queue_bytes(c, (unsigned char *)"D\0\0\0", 4) < 0) { finish(c); return; }
            unsigned char len1 = (unsigned char)strlen(n);
            if (queue_bytes(c, &len1, 1) < 0 || queue_bytes(c, (unsigned char *)n, len1) < 0) { finish(c); return; }
        }
        if (p->kept_len && queue_bytes(c, p->kept + p->kept_off, p->kept_len) < 0) { finish(c); return; }
        p->dropped = 0;
        p->kept_off = p->kept_len = 0;
        if (p->ended) {
            char text[32];
            exit_text(p, text, sizeof text);
            queue_last(c, 'X', text, (uint32_t)strlen(text));
        } else {
            flush(c);
        }
        return;
    }
    if (p->ended) {
        char text[32];
        exit_text(p, text, sizeof text);
        send_frame(c->fd, 'X', text, (uint32_t)strlen(text));
        finish(c);
    }
}

static void list_procs(struct conn *c) {
    static char buf[MAX_INFO + 512];
    for (int i = 0; i < MAX_PROCS; i++) {
        struct proc *p = &procs[i];
        if (!p->used) continue;
        uint32_t n = 0;
        char v[64], code[32] = "", sig[16] = "";
        snprintf(v, sizeof v, "%d", p->pid);
        info_add(buf, &n, "pid", v);
        info_add(buf, &n, "pty", p->pty ? "1" : "0");
        info_add(buf, &n, "background", p->background ? "1" : "0");
        info_add(buf, &n, "stdin", p->in_fd >= 0 && !p->stdin_eof ? "1" : "0");
        info_add(buf, &n, "state", p->exited ? "exited" : "running");
        if (p->exited) {
            exit_text(p, code, sizeof code);
            char *space = strchr(code, ' ');
            if (space) *space = 0, snprintf(sig, sizeof sig, "%s", space + 1);
            info_add(buf, &n, "code", code);
            if (sig[0]) info_add(buf, &n, "signal", sig);
        }
        snprintf(v, sizeof v, "%zu", p->kept_len);
        info_add(buf, &n, "buffered", v);
        snprintf(v, sizeof v, "%llu", p->dropped);
        info_add(buf, &n, "dropped", v);
        if (p->info && n + p->info_len <= sizeof buf) memcpy(buf + n, p->info, p->info_len), n += p->info_len;
        if (send_frame(c->fd, 'L', buf, n) < 0) break;
    }
    finish(c);
}

static void handle_frame(struct conn *c, char type, unsigned char *body, uint32_t len) {
    struct proc *p = c->proc >= 0 ? &procs[c->proc] : NULL;
    if (c->role == ROLE_NEW) {
        if (type == 'R') {
            if (start_command(c, body, len) < 0) finish(c);
        } else if (type == 'A') {
            attach(c, body, len);
        } else if (type == 'L') {
            list_procs(c);
        } else {
            finish(c);
        }
        return;
    }
    if (!p || !p->used) return;
    int done = 1; /* a control connection is told whether each frame did something ('Y' 1 or 0) */
    if (type == 'I' && p->in_fd >= 0 && !p->stdin_eof) {
        unsigned char *nb = realloc(p->pending_in, p->pending_len + len);
        if (!nb) return;
        memcpy(nb + p->pending_len, body, len);
        p->pending_in = nb;
        p->pending_len += len;
    } else if (type == 'E' && p->pty && p->in_fd >= 0) { /* end of input on a terminal: ^D */
        unsigned char *nb = realloc(p->pending_in, p->pending_len + 1);
        if (!nb) return;
        nb[p->pending_len++] = 4;
        p->pending_in = nb;
    } else if (type == 'E' && !p->pty) {
        p->stdin_eof = 1;
        if (p->pending_len == 0) close_fd(&p->in_fd);
    } else if (type == 'K' && p->pid > 0 && !p->exited) {
        char buf[16] = {0};
        memcpy(buf, body, len < 15 ? len : 15);
        int sig = atoi(buf);
        kill_session(p->pid, sig > 0 && sig < NSIG ? sig : SIGKILL);
    } else if (type == 'W' && p->pty && p->out_fd >= 0) {
        char buf[32] = {0};
        memcpy(buf, body, len < 31 ? len : 31);
        long rows = 0, cols = 0;
        if (sscanf(buf, "%ld %ld", &rows, &cols) == 2 && rows > 0 && rows <= 65535 && cols > 0 && cols <= 65535) {
            struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
            ioctl(p->out_fd, TIOCSWINSZ, &ws); /* the kernel sends SIGWINCH to the foreground group */
        }
    } else {
        done = 0;
    }
    if (c->role == ROLE_CONTROL && c->used) send_frame(c->fd, 'Y', done ? "1" : "0", 1);
}

static void read_conn(struct conn *c) {
    for (;;) {
        if (c->proc >= 0 && procs[c->proc].pending_len > MAX_PENDING_IN) return; /* the command must catch up */
        if (c->hdr_got < 5) {
            ssize_t n = recv(c->fd, c->hdr + c->hdr_got, 5 - c->hdr_got, MSG_DONTWAIT);
            if (n == 0) { finish(c); return; }
            if (n < 0) { if (errno != EAGAIN && errno != EINTR) finish(c); return; }
            c->hdr_got += (size_t)n;
            if (c->hdr_got < 5) return;
            c->body_len = ((uint32_t)c->hdr[1] << 24) | ((uint32_t)c->hdr[2] << 16) | ((uint32_t)c->hdr[3] << 8) | c->hdr[4];
            if (c->body_len > MAX_REQUEST) { finish(c); return; }
            c->body = malloc(c->body_len ? c->body_len : 1);
            c->body_got = 0;
            if (!c->body) { finish(c); return; }
        }
        if (c->body_got < c->body_len) {
            ssize_t n = recv(c->fd, c->body + c->body_got, c->body_len - c->body_got, MSG_DONTWAIT);
            if (n == 0) { finish(c); return; }
            if (n < 0) { if (errno != EAGAIN && errno != EINTR) finish(c); return; }
            c->body_got += (size_t)n;
            if (c->body_got < c->body_len) return;
        }
        unsigned char *body = c->body;
        c->body = NULL;
        c->hdr_got = 0;
        handle_frame(c, (char)c->hdr[0], body, c->body_len);
        free(body);
        if (!c->used) return;
    }
}

static void pump_output(int pi, int *fd, char type) {
    unsigned char buf[65536];
    ssize_t n = read(*fd, buf, sizeof buf);
    if (n > 0) {
        deliver(pi, type, buf, (uint32_t)n);
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) { /* a pty master says EIO once the terminal is closed */
        if (procs[pi].pty && fd == &procs[pi].out_fd) {
            /* closing the master hangs the terminal up, and the kernel sends SIGHUP to its session:
             * a command that closed its fds 0-2 (coreutils does at exit) but has not exited yet
             * would die of it. The master closes once the command is reaped. */
            procs[pi].pty_hup = 1;
            close_fd(&procs[pi].in_fd); /* a duplicate: the master stays open */
            return;
        }
        close_fd(fd);
    }
}

static void write_stdin(struct proc *p) {
    while (p->pending_len > 0) {
        ssize_t n = write(p->in_fd, p->pending_in, p->pending_len);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            close_fd(&p->in_fd); /* the command closed its stdin: drop the rest */
            p->pending_len = 0;
            return;
        }
        memmove(p->pending_in, p->pending_in + n, p->pending_len - (size_t)n);
        p->pending_len -= (size_t)n;
    }
    if (p->stdin_eof) close_fd(&p->in_fd);
}

static void reap(void) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) return;
        for (int i = 0; i < MAX_PROCS; i++) {
            struct proc *p = &procs[i];
            if (p->used && p->pid == pid && !p->exited) {
                p->exited = 1;
                p->status = status;
                p->exited_at = now_ns();
            }
        }
    }
}

/* Read exactly len bytes from fd, waiting at most until deadline (now_ns clock). */
static int read_exact_until(int fd, unsigned char *buf, size_t len, long long deadline) {
    size_t got = 0;
    while (got < len) {
        long long left = deadline - now_ns();
        if (left <= 0) return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(left / 1000000) + 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t n = read(fd, buf + got, len - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    return 0;
}

/* The daemon queued one connection carrying the key before handing the socket over: take it. */
static int read_key(int lfd) {
    long long deadline = now_ns() + KEY_WAIT_MS * 1000000LL;
    struct pollfd p = {.fd = lfd, .events = POLLIN};
    int r;
    do r = poll(&p, 1, KEY_WAIT_MS); while (r < 0 && errno == EINTR);
    if (r <= 0) return -1;
    int cfd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (cfd < 0) return -1;
    unsigned char hdr[5];
    int ok = read_exact_until(cfd, hdr, 5, deadline) == 0 && hdr[0] == 'K';
    uint32_t len = ((uint32_t)hdr[1] << 24) | ((uint32_t)hdr[2] << 16) | ((uint32_t)hdr[3] << 8) | hdr[4];
    ok = ok && len > 0 && len <= MAX_KEY && read_exact_until(cfd, key, len, deadline) == 0;
    close(cfd);
    if (!ok) return -1;
    key_len = len;
    return 0;
}

int main(int argc, char **argv) {
    /* First: nothing of the env runs yet, and from here on nothing in it can read or write our
     * memory or descriptors (ptrace access checks need CAP_SYS_PTRACE for an undumpable task). */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
        perror("weenv-agent: prctl(PR_SET_DUMPABLE)");
        return 1;
    }
    int keyed = argc == 4 && !strcmp(argv[3], "--key-first");
    if (argc != 2 && !((argc == 3 || keyed) && !strcmp(argv[1], "--fd"))) {
        fprintf(stderr, "usage: %s --fd N [--key-first] | SOCKET_PATH\n", argv[0]);
        return 2;
    }
    for (int i = 0; i < MAX_CONNS; i++) conns[i].fd = -1, conns[i].proc = -1;
    for (int i = 0; i < MAX_PROCS; i++) procs[i].in_fd = procs[i].out_fd = procs[i].err_fd = -1;
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    int lfd;
    if (argc >= 3) {
        lfd = atoi(argv[2]);
        if (lfd < 3 || fcntl(lfd, F_SETFD, FD_CLOEXEC) < 0) {
            fprintf(stderr, "weenv-agent: fd %s is not an open listening socket\n", argv[2]);
            return 1;
        }
        if (keyed && read_key(lfd) < 0) {
            fprintf(stderr, "weenv-agent: no key from the daemon on fd %s\n", argv[2]);
            return 1;
        }
    } else {
        lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un addr = {.sun_family = AF_UNIX};
        if (lfd < 0 || strlen(argv[1]) >= sizeof addr.sun_path) {
            perror("weenv-agent: socket");
            return 1;
        }
        strcpy(addr.sun_path, argv[1]);
        unlink(argv[1]);
        mode_t old = umask(077);
        if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 128) < 0) {
            perror("weenv-agent: bind");
            return 1;
        }
        umask(old);
    }
    if (sfd < 0) {
        perror("weenv-agent: signalfd");
        return 1;
    }
    enum { K_CONN, K_OUT, K_ERR, K_IN };
    struct pollfd pfds[2 + MAX_CONNS + MAX_PROCS * 3];
    int owners[2 + MAX_CONNS + MAX_PROCS * 3]; /* index in conns or procs */
    int kinds[2 + MAX_CONNS + MAX_PROCS * 3];
    for (;;) {
        int n = 0;
        pfds[n++] = (struct pollfd){.fd = lfd, .events = POLLIN};
        pfds[n++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        long long timeout_ns = -1, now = now_ns();
        for (int i = 0; i < MAX_PROCS; i++) {
            struct proc *p = &procs[i];
            if (!p->used || p->ended) continue;
            int out_open = p->out_fd >= 0 && !p->pty_hup;
            if (p->exited && ((!out_open && p->err_fd < 0) || now - p->exited_at >= DRAIN_GRACE_NS)) {
                end_proc(i);
                continue;
            }
            if (p->exited) {
                long long left = DRAIN_GRACE_NS - (now - p->exited_at);
                if (timeout_ns < 0 || left < timeout_ns) timeout_ns = left;
            }
            if (out_open) pfds[n] = (struct pollfd){.fd = p->out_fd, .events = POLLIN}, owners[n] = i, kinds[n++] = K_OUT;
            if (p->err_fd >= 0) pfds[n] = (struct pollfd){.fd = p->err_fd, .events = POLLIN}, owners[n] = i, kinds[n++] = K_ERR;
            if (p->in_fd >= 0 && p->pending_len > 0)
                pfds[n] = (struct pollfd){.fd = p->in_fd, .events = POLLOUT}, owners[n] = i, kinds[n++] = K_IN;
        }
        for (int i = 0; i < MAX_CONNS; i++) {
            struct conn *c = &conns[i];
            if (!c->used) continue;
            /* a writer whose command is not taking its stdin waits (the daemon's sends block) */
            if (c->proc >= 0 && procs[c->proc].pending_len > MAX_PENDING_IN) continue;
            pfds[n] = (struct pollfd){.fd = c->fd, .events = POLLIN | (c->out_len ? POLLOUT : 0)}, owners[n] = i, kinds[n++] = K_CONN;
        }
        int timeout_ms = timeout_ns < 0 ? -1 : (int)(timeout_ns / 1000000) + 1;
        int r = poll(pfds, (nfds_t)n, timeout_ms);
        if (r < 0 && errno != EINTR) return 1;
        if (pfds[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == sizeof si) {
                /* ssi_pid is 0 for a sender outside our pid namespace (the host): as an env's
                 * init only the host stops the agent; env root sending SIGTERM to pid 1 is ignored. */
                if ((si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) && (si.ssi_pid == 0 || getpid() != 1)) return 0;
            }
            reap();
        }
        if (pfds[0].revents & POLLIN) {
            int cfd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (cfd >= 0) {
                int slot = -1;
                for (int i = 0; i < MAX_CONNS && slot < 0; i++)
                    if (!conns[i].used) slot = i;
                if (slot < 0) {
                    close(cfd);
                } else {
                    struct conn *c = &conns[slot];
                    memset(c, 0, sizeof *c);
                    c->used = 1;
                    c->fd = cfd;
                    c->proc = -1;
                    if (key_len && send_frame(cfd, 'H', key, key_len) < 0) finish(c);
                }
            }
        }
        for (int i = 2; i < n; i++) {
            if (!pfds[i].revents) continue;
            if (kinds[i] == K_CONN) {
                struct conn *c = &conns[owners[i]];
                if (c->used && c->fd == pfds[i].fd && (pfds[i].revents & POLLOUT)) flush(c);
                if (c->used && c->fd == pfds[i].fd && (pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) read_conn(c);
                continue;
            }
            struct proc *p = &procs[owners[i]];
            if (!p->used) continue;
            if (kinds[i] == K_OUT && p->out_fd == pfds[i].fd) pump_output(owners[i], &p->out_fd, p->pty ? 'T' : 'O');
            else if (kinds[i] == K_ERR && p->err_fd == pfds[i].fd) pump_output(owners[i], &p->err_fd, 'e');
            else if (kinds[i] == K_IN && p->in_fd == pfds[i].fd) write_stdin(p);
        }
    }
}
