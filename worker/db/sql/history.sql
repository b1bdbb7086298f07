-- The message store over time (worker/history.py): the console's charts.

-- name: message_history
-- Per bucket of [:t0, :t1) (epoch seconds, :n buckets, 0 first): messages that arrived
-- (receive_timestamp), that ended OK, FAILED, or final at all (OK, FAILED, CANCEL, by their
-- last_process_timestamp); and, in every row, how many are not final now (the backlog at
-- :t1). Neither time is indexed (an index would cost every insert): each call reads the
-- message table twice; the console runs it when its figures page is opened, not on a timer.
WITH buckets AS (SELECT generate_series(0, CAST(:n AS integer) - 1) AS i),
arrived AS (
    SELECT width_bucket(extract(epoch FROM receive_timestamp), :t0, :t1, :n) - 1 AS i,
           count(*) AS n
      FROM message
     WHERE receive_timestamp >= to_timestamp(:t0) AND receive_timestamp < to_timestamp(:t1)
     GROUP BY 1),
ended AS (
    SELECT width_bucket(extract(epoch FROM last_process_timestamp), :t0, :t1, :n) - 1 AS i,
           count(*) FILTER (WHERE state = 'OK') AS ok,
           count(*) FILTER (WHERE state = 'FAILED') AS failed,
           count(*) AS final
      FROM message
     WHERE state IN ('OK', 'FAILED', 'CANCEL')
       AND last_process_timestamp >= to_timestamp(:t0)
       AND last_process_timestamp < to_timestamp(:t1)
     GROUP BY 1)
SELECT b.i, coalesce(a.n, 0) AS arrived, coalesce(e.ok, 0) AS ok,
       coalesce(e.failed, 0) AS failed, coalesce(e.final, 0) AS final,
       (SELECT count(*) FROM message WHERE state NOT IN ('OK', 'FAILED', 'CANCEL')) AS open_now
  FROM buckets b LEFT JOIN arrived a USING (i) LEFT JOIN ended e USING (i)
 ORDER BY b.i;
