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
 * Protocol: one command per connection; frames are [type:1][length:4, big endian][payload].
 *   agent -> daemon  'H' hello (payload: the env's key), first on every connection when keyed
 *   daemon -> agent  'R' request: NUL-terminated key/value strings, keys: arg (repeated, argv),
 *                        env (repeated, NAME=VALUE), cwd, uid, gid, group (repeated), stdin ("1": frames follow)
 *                    'I' stdin bytes      'E' end of stdin      'K' kill (payload: signal number)
 *   agent -> daemon  'P' started (pid)    'O' stdout bytes      'e' stderr bytes
 *                    'F' could not start (payload: "errno message")
 *                    'X' finished (payload: exit code, 128+N for signal N)
 * Closing the connection while the command runs kills the command's whole session.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define MAX_CONNS 256
#define MAX_REQUEST (4u << 20)
#define MAX_ARGS 4096
#define MAX_GROUPS 256
#define DRAIN_GRACE_NS 100000000LL /* wait this long for pipes to close after the command exits */

struct conn {
    int fd;
    int used;
    /* reading a frame */
    unsigned char hdr[5];
    size_t hdr_got;
    unsigned char *body;
    uint32_t body_len;
    size_t body_got;
    /* the command */
    pid_t pid;
    int in_fd, out_fd, err_fd;
    int exited;
    int status;
    long long exited_at;
    unsigned char *pending_in; /* stdin bytes not yet written */
    size_t pending_len;
    int stdin_eof;
};

static struct conn conns[MAX_CONNS];

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

static int send_frame(int fd, char type, const void *data, uint32_t len) {
    unsigned char hdr[5] = {(unsigned char)type, (unsigned char)(len >> 24), (unsigned char)(len >> 16),
                            (unsigned char)(len >> 8), (unsigned char)len};
    if (send_all(fd, hdr, 5) < 0) return -1;
    return len ? send_all(fd, data, len) : 0;
}

static void send_text(int fd, char type, const char *fmt, long long a, const char *s) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, fmt, a, s ? s : "");
    if (n < 0) n = 0;
    if (n >= (int)sizeof buf) n = sizeof buf - 1;
    send_frame(fd, type, buf, (uint32_t)n);
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

static void finish(struct conn *c) {
    if (!c->used) return;
    if (c->pid > 0 && !c->exited) kill_session(c->pid, SIGKILL);
    close_fd(&c->in_fd);
    close_fd(&c->out_fd);
    close_fd(&c->err_fd);
    close_fd(&c->fd);
    free(c->body);
    free(c->pending_in);
    memset(c, 0, sizeof *c);
    c->fd = c->in_fd = c->out_fd = c->err_fd = -1;
}

static void report_exit(struct conn *c) {
    int code;
    if (WIFEXITED(c->status)) code = WEXITSTATUS(c->status);
    else if (WIFSIGNALED(c->status)) code = 128 + WTERMSIG(c->status);
    else code = 255;
    send_text(c->fd, 'X', "%lld%s", code, NULL);
    c->pid = 0; /* reaped: nothing left to kill by this id */
    finish(c);
}

static int start_command(struct conn *c, unsigned char *req, uint32_t len) {
    char *argv[MAX_ARGS + 1];
    char *envp[MAX_ARGS + 1];
    gid_t groups[MAX_GROUPS];
    int argc = 0, envc = 0, ngroups = 0, want_stdin = 0;
    char *cwd = NULL;
    long uid = 0, gid = 0;
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
    }
    argv[argc] = NULL;
    envp[envc] = NULL;
    if (argc == 0) {
        send_text(c->fd, 'F', "%lld %s", EINVAL, "empty argv");
        return -1;
    }
    int in_p[2] = {-1, -1}, out_p[2], err_p[2], st_p[2];
    if (want_stdin ? pipe2(in_p, O_CLOEXEC) : 0) goto fail;
    if (pipe2(out_p, O_CLOEXEC) || pipe2(err_p, O_CLOEXEC) || pipe2(st_p, O_CLOEXEC)) goto fail;
    pid_t pid = fork();
    if (pid < 0) goto fail;
    if (pid == 0) {
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
        setsid();
        int null_fd = open("/dev/null", O_RDONLY);
        dup2(want_stdin ? in_p[0] : (null_fd >= 0 ? null_fd : 0), 0);
        dup2(out_p[1], 1);
        dup2(err_p[1], 2);
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
    if (in_p[0] >= 0) close_fd(&in_p[0]);
    int report[2] = {0, 0};
    ssize_t n;
    do n = read(st_p[0], report, sizeof report); while (n < 0 && errno == EINTR);
    close(st_p[0]);
    c->pid = pid;
    c->out_fd = out_p[0];
    c->err_fd = err_p[0];
    c->in_fd = in_p[1];
    c->stdin_eof = !want_stdin;
    if (c->in_fd >= 0) fcntl(c->in_fd, F_SETFL, O_NONBLOCK);
    if (n == (ssize_t)sizeof report) {
        char what[64];
        snprintf(what, sizeof what, "%s", report[0] == 1 ? "identity" : report[0] == 2 ? "cwd" : "exec");
        send_text(c->fd, 'F', "%lld %s", (long long)report[1] * 10 + report[0], what);
    } else {
        send_text(c->fd, 'P', "%lld%s", pid, NULL);
    }
    return 0;
fail:
    send_text(c->fd, 'F', "%lld %s", errno, "cannot create pipes or fork");
    return -1;
}

static void handle_frame(struct conn *c, char type, unsigned char *body, uint32_t len) {
    if (type == 'R' && c->pid == 0 && c->out_fd < 0) {
        if (start_command(c, body, len) < 0) finish(c);
    } else if (type == 'I' && c->in_fd >= 0) {
        unsigned char *nb = realloc(c->pending_in, c->pending_len + len);
        if (!nb) return;
        memcpy(nb + c->pending_len, body, len);
        c->pending_in = nb;
        c->pending_len += len;
    } else if (type == 'E') {
        c->stdin_eof = 1;
        if (c->pending_len == 0) close_fd(&c->in_fd);
    } else if (type == 'K' && c->pid > 0 && !c->exited) {
        char buf[16] = {0};
        memcpy(buf, body, len < 15 ? len : 15);
        int sig = atoi(buf);
        kill_session(c->pid, sig > 0 ? sig : SIGKILL);
    }
}

static void read_conn(struct conn *c) {
    for (;;) {
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

static void pump_output(struct conn *c, int *fd, char type) {
    char buf[65536];
    ssize_t n = read(*fd, buf, sizeof buf);
    if (n > 0) {
        if (send_frame(c->fd, type, buf, (uint32_t)n) < 0) finish(c);
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        close_fd(fd);
    }
}

static void write_stdin(struct conn *c) {
    while (c->pending_len > 0) {
        ssize_t n = write(c->in_fd, c->pending_in, c->pending_len);
        if (n < 0) {
            if (errno == EAGAIN) return;
            close_fd(&c->in_fd); /* the command closed its stdin: drop the rest */
            c->pending_len = 0;
            return;
        }
        memmove(c->pending_in, c->pending_in + n, c->pending_len - (size_t)n);
        c->pending_len -= (size_t)n;
    }
    if (c->stdin_eof) close_fd(&c->in_fd);
}

static void reap(void) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) return;
        for (int i = 0; i < MAX_CONNS; i++) {
            struct conn *c = &conns[i];
            if (c->used && c->pid == pid && !c->exited) {
                c->exited = 1;
                c->status = status;
                c->exited_at = now_ns();
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
    for (int i = 0; i < MAX_CONNS; i++) conns[i].fd = conns[i].in_fd = conns[i].out_fd = conns[i].err_fd = -1;
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
    struct pollfd pfds[2 + MAX_CONNS * 4];
    struct conn *owners[2 + MAX_CONNS * 4];
    int kinds[2 + MAX_CONNS * 4]; /* 0 conn, 1 stdout, 2 stderr, 3 stdin */
    for (;;) {
        int n = 0;
        pfds[n] = (struct pollfd){.fd = lfd, .events = POLLIN};
        owners[n++] = NULL;
        pfds[n] = (struct pollfd){.fd = sfd, .events = POLLIN};
        owners[n++] = NULL;
        long long timeout_ns = -1, now = now_ns();
        for (int i = 0; i < MAX_CONNS; i++) {
            struct conn *c = &conns[i];
            if (!c->used) continue;
            if (c->exited && ((c->out_fd < 0 && c->err_fd < 0) || now - c->exited_at >= DRAIN_GRACE_NS)) {
                report_exit(c);
                continue;
            }
            if (c->exited) {
                long long left = DRAIN_GRACE_NS - (now - c->exited_at);
                if (timeout_ns < 0 || left < timeout_ns) timeout_ns = left;
            }
            pfds[n] = (struct pollfd){.fd = c->fd, .events = POLLIN};
            owners[n] = c, kinds[n++] = 0;
            if (c->out_fd >= 0) pfds[n] = (struct pollfd){.fd = c->out_fd, .events = POLLIN}, owners[n] = c, kinds[n++] = 1;
            if (c->err_fd >= 0) pfds[n] = (struct pollfd){.fd = c->err_fd, .events = POLLIN}, owners[n] = c, kinds[n++] = 2;
            if (c->in_fd >= 0 && c->pending_len > 0)
                pfds[n] = (struct pollfd){.fd = c->in_fd, .events = POLLOUT}, owners[n] = c, kinds[n++] = 3;
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
                    c->in_fd = c->out_fd = c->err_fd = -1;
                    if (key_len && send_frame(cfd, 'H', key, key_len) < 0) finish(c);
                }
            }
        }
        for (int i = 2; i < n; i++) {
            struct conn *c = owners[i];
            if (!c->used || !pfds[i].revents) continue;
            if (kinds[i] == 0) read_conn(c);
            else if (kinds[i] == 1 && c->out_fd == pfds[i].fd) pump_output(c, &c->out_fd, 'O');
            else if (kinds[i] == 2 && c->err_fd == pfds[i].fd) pump_output(c, &c->err_fd, 'e');
            else if (kinds[i] == 3 && c->in_fd == pfds[i].fd) write_stdin(c);
        }
    }
}
