//! A futureless task runtime for Linux: tasks are values run on a growing thread pool and park on kernel events.
