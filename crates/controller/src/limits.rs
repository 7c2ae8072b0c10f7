//! Every bound of the controller in one place.

/// Cache and NVS unit: a track of 4 KiB (also the export's minimum and
/// preferred block size).
pub const TRACK_BYTES: usize = 4096;
/// Largest READ/WRITE payload (advertised maximum payload).
pub const MAX_PAYLOAD_BYTES: u32 = 32 << 20;
/// Largest write payload read off the wire only to be discarded (a larger
/// one ends the connection).
pub const DISCARD_PAYLOAD_MAX: u32 = 64 << 20;
/// Largest volume.
pub const VOLUME_BYTES_MAX: u64 = 1 << 44;
/// Most backend devices per volume.
pub const DEVICES_MAX: u32 = 64;
/// Most rcs workers.
pub const WORKERS_MAX: usize = 64;
/// Most concurrent NBD connections.
pub const CONNECTIONS_MAX: usize = 1024;
/// Threads per connection.
pub const CONNECTION_THREADS_MAX: usize = 64;
/// Requests in flight per connection before the reader stops reading.
pub const INFLIGHT_PER_CONNECTION_MAX: u32 = 256;
/// Cache directory shards (a power of two).
pub const CACHE_SHARDS: usize = 64;
/// Tracks one destage task writes before yielding the worker.
pub const DESTAGE_BATCH_TRACKS: usize = 32;
/// Destage tasks in flight at once.
pub const DESTAGE_TASKS_MAX: u32 = 2;
/// Socket read buffer of a connection.
pub const CONNECTION_READ_BUFFER_BYTES: usize = 256 << 10;
/// Deepest device submission queue accepted.
pub const DEVICE_QUEUE_DEPTH_MAX: u32 = 4096;
/// Largest request control-block pool accepted.
pub const CONTROL_BLOCKS_MAX: u32 = 1 << 20;
