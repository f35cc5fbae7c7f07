"""The process a run lives in: the console it prints to and keeps, the processes it starts and supervises,
and start-up. Import each by its module."""
