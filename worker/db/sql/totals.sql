-- Running totals of the metrics' counters and histograms (worker/totals.py).

-- name: metric_add
-- Adds each series' increment to its total, the series made on its first increment. The rows
-- go in (name, labels) order, so two processes adding at once lock shared rows in one order.
INSERT INTO metric_total AS t (name, labels, value)
SELECT n, l, v
  FROM unnest(CAST(:names AS text[]), CAST(:labels AS text[]), CAST(:values AS float8[]))
       AS i(n, l, v)
 ORDER BY n, l
ON CONFLICT (name, labels) DO UPDATE
   SET value = t.value + EXCLUDED.value, updated_at = now();

-- name: metric_totals
-- Every series and its total, for a scrape.
SELECT name, labels, value FROM metric_total ORDER BY name, labels;
