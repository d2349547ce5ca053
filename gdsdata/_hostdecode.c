/* Host Huffman decoding of JPEGs without the interpreter (nvjpeg_host.py).
 *
 * nvJPEG's decoupled phases take four library calls per image. Made from Python through ctypes,
 * each call hands the interpreter lock back and takes it again; a dozen threads doing that beside
 * the Loader's own threads spend their time waiting for the lock. Measured on the H200 with one
 * native call per run of images but Python worker threads around it, the threads still spent only
 * about 4 ms of a 10 ms batch in the native loop. So the threads are native too: gds_pool_* runs a
 * batch's host part on threads of its own, started and awaited with one call each, which never
 * touch the interpreter.
 *
 * The library's functions come in as pointers (from the libnvjpeg that gdsdata loaded), so this file
 * needs neither nvJPEG's headers nor its library at build time. It is built as an (otherwise empty)
 * extension module so that setuptools compiles it; gdsdata loads it with ctypes.
 *
 * Each image k of a run uses slot k: its own decoder state, with its own pinned and device buffers
 * attached once, and its own parsed-stream object. All host phases run first, then the transfers
 * and device phases are queued on `stream`, so the thread never waits for the GPU here. The caller
 * makes sure the previous run's queued work has finished before a slot is used again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
    unsigned char *channel[4];
    size_t pitch[4];
} gds_image_t; /* nvjpegImage_t of CUDA 13's nvJPEG */

typedef struct {
    unsigned char *channel[4];
    unsigned int pitch[4];
} gds_image12_t; /* nvjpegImage_t of CUDA 12's */

typedef int (*parse_fn)(void *handle, const unsigned char *data, size_t length, int save_metadata,
                        int save_stream, void *jpeg_stream);
typedef int (*host_fn)(void *handle, void *decoder, void *state, void *params, void *jpeg_stream);
typedef int (*transfer_fn)(void *handle, void *decoder, void *state, void *jpeg_stream, void *stream);
typedef int (*device_fn)(void *handle, void *decoder, void *state, void *destination, void *stream);

typedef struct {
    parse_fn parse;       /* nvjpegJpegStreamParse */
    host_fn host;         /* nvjpegDecodeJpegHost */
    transfer_fn transfer; /* nvjpegDecodeJpegTransferToDevice */
    device_fn device;     /* nvjpegDecodeJpegDevice */
} gds_nvjpeg_fns;

/* The host phases of images 0..n-1 (n <= the number of slots): parse, Huffman decoding into the
 * slot's pinned buffer. status[k]: 0, or 1000 * phase + nvJPEG's status (phase 1 parse, 2 host). */
static void host_phases(const gds_nvjpeg_fns *fns, void *handle, void *decoder, void *params, void *const *states,
                        void *const *jpeg_streams, const uint64_t *data, const uint64_t *lengths, int n,
                        int32_t *status) {
    for (int k = 0; k < n; k++) {
        int s = fns->parse(handle, (const unsigned char *)(uintptr_t)data[k], (size_t)lengths[k], 0, 0,
                           jpeg_streams[k]);
        if (s == 0) {
            s = fns->host(handle, decoder, states[k], params, jpeg_streams[k]);
            status[k] = s ? 2000 + s : 0;
        } else {
            status[k] = 1000 + s;
        }
    }
}

/* The queued phases of the images whose host phases succeeded: the copy to the GPU and the kernels
 * writing RGB interleaved pixels to outs[k] (row pitch pitches[k]), on `stream` (phases 3 and 4 of
 * status). pitch32: the library's nvjpegImage_t has CUDA 12's 32-bit pitches. Returns the number
 * of failed images. */
static int device_phases(const gds_nvjpeg_fns *fns, void *handle, void *decoder, void *const *states,
                         void *const *jpeg_streams, const uint64_t *outs, const uint64_t *pitches, int n,
                         void *stream, int pitch32, int32_t *status) {
    int failed = 0;
    for (int k = 0; k < n; k++) {
        if (status[k] == 0) {
            gds_image_t image = {{0}, {0}};
            gds_image12_t image12 = {{0}, {0}};
            image.channel[0] = image12.channel[0] = (unsigned char *)(uintptr_t)outs[k];
            image.pitch[0] = (size_t)pitches[k];
            image12.pitch[0] = (unsigned int)pitches[k];
            void *destination = pitch32 ? (void *)&image12 : (void *)&image;
            int s = fns->transfer(handle, decoder, states[k], jpeg_streams[k], stream);
            if (s) {
                status[k] = 3000 + s;
            } else if ((s = fns->device(handle, decoder, states[k], destination, stream)) != 0) {
                status[k] = 4000 + s;
            }
        }
        failed += status[k] != 0;
    }
    return failed;
}

/* Decode images 0..n-1 (n <= the number of slots) on this thread: every host phase, then every
 * queued phase on `stream`. Returns the number of failed images. */
int gds_host_decode(const gds_nvjpeg_fns *fns, void *handle, void *decoder, void *params,
                    void *const *states, void *const *jpeg_streams, const uint64_t *data,
                    const uint64_t *lengths, const uint64_t *outs, const uint64_t *pitches, int n,
                    void *stream, int pitch32, int32_t *status) {
    host_phases(fns, handle, decoder, params, states, jpeg_streams, data, lengths, n, status);
    return device_phases(fns, handle, decoder, states, jpeg_streams, outs, pitches, n, stream, pitch32, status);
}

/* --- a pool of native threads, each decoding its part of a batch ------------------------------- */

typedef struct {
    void *handle, *decoder, *params; /* the part's thread's nvJPEG objects */
    void *const *states;              /* its slots for this part (at least hi - lo) */
    void *const *jpeg_streams;
    int lo, hi;                       /* the part: images lo..hi-1 of the batch */
} gds_part;

typedef struct gds_pool gds_pool;

typedef struct {
    gds_pool *pool;
    int index;
} gds_worker;

struct gds_pool {
    int threads;
    pthread_t *ids;
    gds_worker *workers;
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    unsigned long generation; /* bumped by each submit */
    int pending, stop, started;
    struct timespec submitted;
    int64_t slowest_ns; /* the latest end of a part, after the submit */
    /* the batch being decoded */
    const gds_nvjpeg_fns *fns;
    const gds_part *parts;
    const uint64_t *data, *lengths, *outs, *pitches;
    int pitch32;
    int32_t *status;
};

void gds_pool_destroy(gds_pool *pool);

static int64_t since_ns(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (int64_t)(t1.tv_sec - t0->tv_sec) * 1000000000 + (t1.tv_nsec - t0->tv_nsec);
}

static void *pool_thread(void *arg) {
    gds_worker *me = (gds_worker *)arg;
    gds_pool *pool = me->pool;
    unsigned long seen = 0;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->stop && pool->generation == seen)
            pthread_cond_wait(&pool->work, &pool->lock);
        if (pool->stop)
            break;
        seen = pool->generation;
        const gds_part *part = &pool->parts[me->index];
        pthread_mutex_unlock(&pool->lock);
        if (part->hi > part->lo)
            host_phases(pool->fns, part->handle, part->decoder, part->params, part->states, part->jpeg_streams,
                        pool->data + part->lo, pool->lengths + part->lo, part->hi - part->lo, pool->status + part->lo);
        int64_t ended = since_ns(&pool->submitted);
        pthread_mutex_lock(&pool->lock);
        if (ended > pool->slowest_ns)
            pool->slowest_ns = ended;
        if (--pool->pending == 0)
            pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

/* Start `threads` native threads; NULL if they cannot be started. */
gds_pool *gds_pool_create(int threads) {
    gds_pool *pool = calloc(1, sizeof(gds_pool));
    if (!pool)
        return NULL;
    pool->ids = calloc((size_t)threads, sizeof(pthread_t));
    pool->workers = calloc((size_t)threads, sizeof(gds_worker));
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->work, NULL);
    pthread_cond_init(&pool->done, NULL);
    if (pool->ids && pool->workers) {
        for (; pool->started < threads; pool->started++) {
            pool->workers[pool->started].pool = pool;
            pool->workers[pool->started].index = pool->started;
            if (pthread_create(&pool->ids[pool->started], NULL, pool_thread, &pool->workers[pool->started]))
                break;
        }
    }
    pool->threads = pool->started;
    if (pool->started < threads) {
        gds_pool_destroy(pool);
        return NULL;
    }
    return pool;
}

/* Hand thread t the part parts[t] of a batch (one part per thread) for its host phases and return
 * at once. The arrays must stay valid until gds_pool_wait returns. */
void gds_pool_submit(gds_pool *pool, const gds_nvjpeg_fns *fns, const gds_part *parts, const uint64_t *data,
                     const uint64_t *lengths, const uint64_t *outs, const uint64_t *pitches, int pitch32,
                     int32_t *status) {
    pthread_mutex_lock(&pool->lock);
    pool->fns = fns;
    pool->parts = parts;
    pool->data = data;
    pool->lengths = lengths;
    pool->outs = outs;
    pool->pitches = pitches;
    pool->pitch32 = pitch32;
    pool->status = status;
    pool->slowest_ns = 0;
    pool->pending = pool->threads;
    clock_gettime(CLOCK_MONOTONIC, &pool->submitted);
    pool->generation++;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
}

/* Wait until every part's host phases are done, then queue the queued phases of every image on
 * `stream`, from this thread: the pool's threads never wait for the GPU. queue = 0 leaves them out
 * (a probe of the host phases alone: the images are not decoded). Returns the number of failed
 * images (status as gds_host_decode's); *elapsed_ns: from the submit to the end of the slowest
 * part's host phases. */
int gds_pool_wait(gds_pool *pool, void *stream, int queue, int64_t *elapsed_ns) {
    pthread_mutex_lock(&pool->lock);
    while (pool->pending > 0)
        pthread_cond_wait(&pool->done, &pool->lock);
    *elapsed_ns = pool->slowest_ns;
    pthread_mutex_unlock(&pool->lock);
    int failed = 0;
    for (int t = 0; t < pool->threads; t++) {
        const gds_part *part = &pool->parts[t];
        if (!queue) {
            for (int k = part->lo; k < part->hi; k++)
                failed += pool->status[k] != 0;
        } else if (part->hi > part->lo)
            failed += device_phases(pool->fns, part->handle, part->decoder, part->states, part->jpeg_streams,
                                    pool->outs + part->lo, pool->pitches + part->lo, part->hi - part->lo, stream,
                                    pool->pitch32, pool->status + part->lo);
    }
    return failed;
}

void gds_pool_destroy(gds_pool *pool) {
    if (!pool)
        return;
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    for (int t = 0; t < pool->started; t++)
        pthread_join(pool->ids[t], NULL);
    pthread_mutex_destroy(&pool->lock);
    pthread_cond_destroy(&pool->work);
    pthread_cond_destroy(&pool->done);
    free(pool->ids);
    free(pool->workers);
    free(pool);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hostdecode",
                                    "gdsdata native host Huffman decoding (loaded with ctypes)", -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hostdecode(void) { return PyModule_Create(&module); }
