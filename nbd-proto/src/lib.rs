//! The NBD wire protocol as a sans-IO codec (bytes in, events out).
