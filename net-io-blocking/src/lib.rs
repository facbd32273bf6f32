//! A bounded blocking TCP server driver: accept threads, a bounded worker pool, caps, deadlines, kill and drain.
