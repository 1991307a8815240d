output "id" {
  description = "The bucket's name."
  value       = aws_s3_bucket.this.id
}

output "arn" {
  description = "The bucket's ARN."
  value       = aws_s3_bucket.this.arn
}

output "store_url" {
  description = "The bucket and prefix as an rlbus --store URL."
  value       = "s3://${aws_s3_bucket.this.id}/${trimsuffix(var.weights_prefix, "/")}"
}
