"""The process a command runs in: threads, the allocator, the process group, library output."""
